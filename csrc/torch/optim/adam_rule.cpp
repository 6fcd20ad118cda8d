// The Adam / AdamW rule: our fused CPU Adam (csrc/core/kernels/cpu_adam.h) on the host, our device kernel
// (csrc/cuda/adam_kernel.h) on the GPU, which computes the same bits: a set steps identically on
// either tier. Hyperparameters: lr, beta1, beta2, eps, weight_decay and adamw (1: decoupled weight
// decay). With bf16 moments (GeminiConfig.optimizer_state_dtype) the host runs
// csrc/core/kernels/cpu_adam_bf16_moments.h and the device kernel rounds the moments the same way;
// with master_weights=False as well, the master is the bf16 parameter chunk, rounded alike.
#include <optional>

#include "core/kernels/adam_correction.h"
#include "core/kernels/cpu_adam.h"
#include "core/errors.h"
#include "torch/optim/cpu_adam_op.h"
#include "torch/optim/device_adam_op.h"
#include "torch/optim/optimizer_rule.h"

namespace gx::torch_layer {

namespace {

AdamHyper adam_hyper(const HyperValues& h, int64_t step, double grad_multiplier) {
  AdamHyper out;
  out.lr = hyper_value(h, "lr", "adam");
  out.beta1 = hyper_value(h, "beta1", "adam");
  out.beta2 = hyper_value(h, "beta2", "adam");
  out.eps = hyper_value(h, "eps", "adam");
  out.weight_decay = hyper_value(h, "weight_decay", "adam");
  out.decoupled_weight_decay = hyper_value(h, "adamw", "adam") != 0.0;
  out.step = step;
  out.grad_scale = grad_multiplier;
  return out;
}

// The raw buffers of an fp32-state run, checked, as the in-place step used them.
CpuAdamWork in_place_work(const RunViews& run, int64_t step, const HyperValues& hyper, double taken) {
  std::optional<at::Tensor> p16;
  if (run.param16.defined()) p16 = run.param16;
  CpuAdamWork w = prepare_cpu_adam(run.master, run.states.at(0), run.states.at(1), run.grad, p16,
                                   adam_hyper(hyper, step, taken), run.random_key, run.first_index);
  GX_INTERNAL_ASSERT(!w.moments.has_value(), "an Adam run with bf16 moments was speculated in place");
  return w;
}

class AdamRule final : public OptimizerRule {
 public:
  const std::vector<StateKind>& state_kinds() const override { return kinds_; }

  std::function<void()> prepare_host_run(const RunViews& run, const RunSpares* spares, int64_t step,
                                         const HyperValues& hyper, double grad_multiplier) const override {
    std::optional<at::Tensor> p16;
    if (run.param16.defined()) p16 = run.param16;
    CpuAdamWork w = prepare_cpu_adam(run.master, run.states.at(0), run.states.at(1), run.grad, p16,
                                     adam_hyper(hyper, step, grad_multiplier), run.random_key, run.first_index);
    if (spares != nullptr) {
      if (w.moments.has_value() && w.moments->param != nullptr) {
        w.moments->param_out = static_cast<uint16_t*>(spares->master);
      } else {
        w.buffers.param_out = static_cast<float*>(spares->master);
      }
      if (w.moments.has_value()) {
        w.moments->exp_avg_out = static_cast<uint16_t*>(spares->states.at(0));
        w.moments->exp_avg_sq_out = static_cast<uint16_t*>(spares->states.at(1));
      } else {
        w.buffers.exp_avg_out = static_cast<float*>(spares->states.at(0));
        w.buffers.exp_avg_sq_out = static_cast<float*>(spares->states.at(1));
      }
      if (spares->param16 != nullptr) {
        w.buffers.param16 = spares->param16;
        w.buffers.param16_dtype = spares->param16_dtype;
      }
      w.check();
    }
    return [w] { w.run(best_simd_isa()); };
  }

  bool device_run(const RunViews& run, int64_t step, const HyperValues& hyper,
                  double grad_multiplier) const override {
    const AdamHyper h = adam_hyper(hyper, step, grad_multiplier);
    std::optional<at::Tensor> p16;
    if (run.param16.defined()) p16 = run.param16;
    if (run.master.device().is_cuda()) {
      device_adam_step(run.master, run.states.at(0), run.states.at(1), run.grad, p16, h, run.random_key,
                       run.first_index, run.device_max_blocks);
    } else {  // the simulated device is host memory: the CPU kernel, the same arithmetic
      prepare_cpu_adam(run.master, run.states.at(0), run.states.at(1), run.grad, p16, h, run.random_key,
                       run.first_index)
          .run(best_simd_isa());
    }
    return true;  // the kernels write the 16-bit copy
  }

  bool steps_over_the_link() const override { return true; }

  // fp32 master and moments: core/kernels/adam_correction.h. bf16 moments are rounded
  // stochastically, which a correction could not reproduce: they speculate with spares.
  bool corrects_in_place(DType master, DType state) const override {
    return master == DType::kFloat32 && state == DType::kFloat32;
  }

  std::function<void()> prepare_host_correction(const RunViews& run, int64_t step, const HyperValues& hyper,
                                                double taken, double true_multiplier) const override {
    const CpuAdamWork w = in_place_work(run, step, hyper, taken);
    // see [Note: correcting a speculative Adam step] (core/kernels/adam_correction.h)
    return [w, true_multiplier] { adam_correct_step(w.hyper, true_multiplier, w.buffers); };
  }

  std::function<void()> prepare_host_undo(const RunViews& run, int64_t step, const HyperValues& hyper,
                                          double taken) const override {
    const CpuAdamWork w = in_place_work(run, step, hyper, taken);
    return [w] { adam_undo_step(w.hyper, w.buffers); };
  }

 private:
  std::vector<StateKind> kinds_{StateKind::kExpAvg, StateKind::kExpAvgSq};
};

}  // namespace

std::unique_ptr<OptimizerRule> make_adam_rule() { return std::make_unique<AdamRule>(); }

}  // namespace gx::torch_layer
