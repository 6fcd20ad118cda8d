// HybridAdam: the optimizer step over chunk sets, CPU Adam where the state is on the host and
// torch's fused Adam where it is on the device.
//
// Design note.
//  * Units of work. Within a chunk set, consecutive slots that have a gradient, belong to the
//    same parameter group and have taken the same number of steps form one run; a run is one
//    kernel call over its element range (alignment padding between slots included: it is zero in
//    every companion and stays zero). Slots without a gradient are skipped, exactly as
//    torch.optim skips a parameter whose grad is None, and keep their own step count.
//  * Host sets: our fused CPU Adam reads the fp32 master, m, v and the 16-bit (or fp32)
//    gradient from the pinned host copies and writes master, m, v and the 16-bit parameter into
//    P's host copy in one pass. P's device copy is then refreshed by one H2D copy (home on the
//    device) or dropped (home on the host).
//  * Device sets: torch's _fused_adamw_ / _fused_adam_ on the device copies (the gradient cast
//    to fp32 first), then the master is rounded into P's device copy; a stale host copy of P is
//    dropped.
//  * Host sets run on the manager's optimizer thread, in forward order, and step() returns
//    before they finish (gemini_pipeline.cpp; the Note in step() says why this is exact).
//    GeminiConfig.overlap_optimizer=False settles each one before step() returns.
//  * `grad_multiplier` folds 1/loss_scale and the clipping coefficient into one factor applied
//    to every gradient, so clipping costs no extra pass.
#pragma once

#include <vector>

#include "core/cpu_adam.h"
#include "torch/gemini_manager.h"

namespace gx::torch_layer {

struct StepStats {
  int64_t host_params = 0;    // elements stepped by CPU Adam in the last step
  int64_t device_params = 0;  // elements stepped by the fused device Adam
  double host_seconds = 0.0;  // CPU Adam time on the optimizer thread of the sets settled so far
  double launch_seconds = 0.0;  // time step() spent preparing and handing over the host sets
  double device_seconds = 0.0;  // host time to launch (device kernels run asynchronously)
  int64_t pending_sets = 0;     // host sets whose step has not been settled yet
};

class HybridAdam {
 public:
  explicit HybridAdam(GeminiManager& manager);
  // Parameter group of each parameter (-1: not in the optimizer; never stepped).
  void set_param_groups(std::vector<int> group_of_param);
  // Sum of squares of every gradient held in G chunks, in fp32 (waits for gradient moves).
  double grad_norm_sq();
  // One AdamHyper per parameter group (its `step` and `grad_scale` fields are ignored: steps are
  // counted per parameter, and `grad_multiplier` applies to every gradient).
  void step(const std::vector<AdamHyper>& groups, double grad_multiplier);
  StepStats last_step() const;  // settles nothing: host_seconds covers the sets settled so far

 private:
  GeminiManager& m_;
  std::vector<int> group_of_param_;
  StepStats stats_;
};

}  // namespace gx::torch_layer
