// OptimizerRule: the math of one optimizer family, behind the generic set stepping of
// HybridOptimizer (hybrid_optimizer.h).
//
// Design note. Stepping a chunk set is the same for every optimizer: which slots form runs,
// where the set's state lives, keeping P's copies coherent, the overlapped CPU pipeline and
// speculation. What differs is declared by a rule:
//  * state_kinds(): the state chunks every trainable set carries besides its master, in order
//    (Adam: exp_avg, exp_avg_sq); fp32, or bf16 for a rule that supports it (Adam). The engine lays them out and the
//    checkpoints, state dicts and close() iterate them;
//  * a host run: checked now against the run's tensors, returned as work on raw host memory
//    for the optimizer thread (the CPU kernel of csrc/core); with spares it writes the master,
//    the states and the 16-bit parameter out of place (a speculative step);
//  * a device run: launched now on the device copies (our kernel for Adam, torch's fused or
//    foreach kernels for the others); it says whether it also wrote the 16-bit copy, else the
//    caller copies the master into it;
//  * where its math allows, the correction and the undo of a host run stepped in place with a
//    guessed gradient multiplier (the in-place speculation of hybrid_optimizer_in_place.cpp):
//    Adam / AdamW with fp32 state (core/kernels/adam_correction.h); the other rules do not
//    correct, and speculate with spare copies instead;
//  * or, for a rule that steps whole sets in the caller's thread (the generic rule, which hands a
//    user's torch optimizer per-parameter views: generic_rule.cpp), step_whole_set on either tier.
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
#include "core/chunk_set.h"

namespace gx::torch_layer {

using HyperValues = std::map<std::string, double>;

// One run's elements in this rank's shard, as tensors on the tier where the set's state lives.
struct RunViews {
  at::Tensor master;               // the master (fp32), or P itself: fp32 parameters, or bf16 ones without masters
  std::vector<at::Tensor> states;  // in the rule's order: fp32, or bf16 where the engine keeps them so
  at::Tensor grad;                 // compute dtype
  at::Tensor param16;              // the 16-bit copy to write; undefined: none (fp32 parameters)
  // Stochastic rounding of bf16 states (core/kernels/stochastic_round.h): the step's key for this chunk
  // and the index of the run's first element within its chunk (the same on every rank and path).
  uint32_t random_key = 0;
  uint32_t first_index = 0;
  int device_max_blocks = 0;  // device kernels: a cap on their blocks (0: none; the link lane's)
};

// A speculative host run's outputs: spare buffers of the same layout, at the run's first element.
struct RunSpares {
  void* master = nullptr;     // of the master chunk's dtype (RunViews::master's)
  std::vector<void*> states;  // of each state chunk's dtype
  void* param16 = nullptr;  // nullptr: fp32 parameters (the master is the parameter)
  DType param16_dtype = DType::kBFloat16;
};

class OptimizerRule {
 public:
  virtual ~OptimizerRule() = default;
  virtual const std::vector<StateKind>& state_kinds() const = 0;
  virtual std::function<void()> prepare_host_run(const RunViews& run, const RunSpares* spares, int64_t step,
                                                 const HyperValues& hyper, double grad_multiplier) const = 0;
  // Returns true when it wrote run.param16 too.
  virtual bool device_run(const RunViews& run, int64_t step, const HyperValues& hyper,
                          double grad_multiplier) const = 0;
  // Whole-set rules: no host kernel, no overlap, no speculation; the caller's thread steps every
  // set, host or device, with step_whole_set (`params`: the set's parameters that have a
  // gradient and an optimizer group). HybridOptimizer then rewrites P from the master.
  virtual bool steps_whole_sets() const { return false; }
  // Whether device_run's kernel honours RunViews::device_max_blocks, as the link lane needs.
  virtual bool steps_over_the_link() const { return false; }
  virtual void step_whole_set(int set_index, const RunViews& set, const std::vector<int>& params,
                              double grad_multiplier) const;
  // In-place speculation. Whether host runs with master and states of these dtypes, stepped in
  // place with multiplier `taken`, can be corrected to another multiplier or undone.
  virtual bool corrects_in_place(DType master, DType state) const { return false; }
  // The run was stepped in place by prepare_host_run(run, nullptr, step, hyper, taken): make it
  // the step with `true_multiplier` (the 16-bit copy rewritten too), or undo it.
  virtual std::function<void()> prepare_host_correction(const RunViews& run, int64_t step, const HyperValues& hyper,
                                                        double taken, double true_multiplier) const;
  virtual std::function<void()> prepare_host_undo(const RunViews& run, int64_t step, const HyperValues& hyper,
                                                  double taken) const;
};

// The native rule named `name` ("adam", "sgd", "lion", "adagrad") carrying state chunks of `kinds`
// (checked against what it needs: plain SGD needs none, SGD with momentum a momentum_buffer);
// UsageError naming the known rules otherwise.
std::unique_ptr<OptimizerRule> make_optimizer_rule(const std::string& name, const std::vector<StateKind>& kinds);

// The generic rule: `step_set` steps one set's parameters given their master and gradient
// views on the set's tier (generic_rule.cpp).
using WholeSetStep = std::function<void(int set_index, const at::Tensor& master, const at::Tensor& grad,
                                        const std::vector<int>& params, double grad_multiplier)>;
std::unique_ptr<OptimizerRule> make_generic_rule(WholeSetStep step_set);

// A hyperparameter of a group, or a UsageError naming the rule and the missing key.
double hyper_value(const HyperValues& hyper, const char* key, const char* rule);

}  // namespace gx::torch_layer
