// OptimizerRule: the math of one optimizer family, behind the generic set stepping of
// HybridOptimizer (hybrid_optimizer.h).
//
// Design note. Stepping a chunk set is the same for every optimizer: which slots form runs,
// where the set's state lives, keeping P's copies coherent, the overlapped CPU pipeline and
// speculation. What differs is declared by a rule:
//  * state_kinds(): the fp32 state chunks every trainable set carries besides its master, in
//    order (Adam: exp_avg, exp_avg_sq). The engine lays them out and the checkpoints, state
//    dicts and close() iterate them;
//  * a host run: checked now against the run's tensors, returned as work on raw host memory
//    for the optimizer thread (the CPU kernel of csrc/core); with spares it writes the master,
//    the states and the 16-bit parameter out of place (a speculative step);
//  * a device run: launched now on the device copies (torch's fused kernels where they exist).
// Hyperparameters arrive per parameter group as name -> value (the Python rule writes them);
// `step` is the count after this update and `grad_multiplier` folds 1/loss_scale and clipping.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/types.h"
#include "torch/chunk_set.h"

namespace gx::torch_layer {

using HyperValues = std::map<std::string, double>;

// One run's elements in this rank's shard, as tensors on the tier where the set's state lives.
struct RunViews {
  at::Tensor master;               // fp32: the master, or P itself for fp32 parameters
  std::vector<at::Tensor> states;  // fp32, in the rule's order
  at::Tensor grad;                 // compute dtype
  at::Tensor param16;              // the 16-bit copy to write (host runs); undefined: none
};

// A speculative host run's outputs: spare buffers of the same layout, at the run's first element.
struct RunSpares {
  float* master = nullptr;
  std::vector<float*> states;
  void* param16 = nullptr;  // nullptr: fp32 parameters (the master is the parameter)
  DType param16_dtype = DType::kBFloat16;
};

class OptimizerRule {
 public:
  virtual ~OptimizerRule() = default;
  virtual const std::vector<StateKind>& state_kinds() const = 0;
  virtual std::function<void()> prepare_host_run(const RunViews& run, const RunSpares* spares, int64_t step,
                                                 const HyperValues& hyper, double grad_multiplier) const = 0;
  virtual void device_run(const RunViews& run, int64_t step, const HyperValues& hyper,
                          double grad_multiplier) const = 0;
};

// The rule named `name` ("adam"); UsageError naming the known rules otherwise.
std::unique_ptr<OptimizerRule> make_optimizer_rule(const std::string& name);

// A hyperparameter of a group, or a UsageError naming the rule and the missing key.
double hyper_value(const HyperValues& hyper, const char* key, const char* rule);

}  // namespace gx::torch_layer
