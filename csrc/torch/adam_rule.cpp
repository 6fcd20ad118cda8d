// The Adam / AdamW rule: our fused CPU Adam (csrc/core/cpu_adam.h) on the host, torch's
// _fused_adam(w)_ on the device. Hyperparameters: lr, beta1, beta2, eps, weight_decay and adamw
// (1: decoupled weight decay). With bf16 moments (GeminiConfig.optimizer_state_dtype) the host
// runs csrc/core/cpu_adam_bf16_moments.h and the device widens slices of the moments to fp32,
// steps them with the fused kernel and narrows them back with the same stochastic rounding.
#include <ATen/TensorOperators.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/full.h>

#include <algorithm>

#include "core/cpu_adam.h"
#include "core/errors.h"
#include "core/stochastic_round.h"
#include "torch/cpu_adam_op.h"
#include "torch/optimizer_rule.h"
#include "torch/stochastic_round_op.h"

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

class AdamRule final : public OptimizerRule {
 public:
  const std::vector<StateKind>& state_kinds() const override { return kinds_; }

  std::function<void()> prepare_host_run(const RunViews& run, const RunSpares* spares, int64_t step,
                                         const HyperValues& hyper, double grad_multiplier) const override {
    const AdamHyper h = adam_hyper(hyper, step, grad_multiplier);
    std::optional<at::Tensor> p16;
    if (run.param16.defined()) p16 = run.param16;
    CpuAdamWork w = prepare_cpu_adam(run.master, run.states.at(0), run.states.at(1), run.grad, p16, step, h.lr,
                                     h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled_weight_decay,
                                     grad_multiplier, run.random_key, run.first_index);
    if (spares != nullptr) {
      w.buffers.param_out = spares->master;
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

  void device_run(const RunViews& run, int64_t step, const HyperValues& hyper,
                  double grad_multiplier) const override {
    const AdamHyper h = adam_hyper(hyper, step, grad_multiplier);
    at::Tensor g = run.grad.to(at::kFloat);
    if (grad_multiplier != 1.0) g = g.mul(grad_multiplier);
    at::Tensor step_t = at::full({}, static_cast<double>(step), run.master.options());
    if (run.states.at(0).scalar_type() != at::kBFloat16) {
      fused(h, run.master, g, run.states.at(0), run.states.at(1), step_t);
      return;
    }
    // bf16 moments: widened slice by slice (bounded fp32 temporaries), stepped, narrowed back.
    constexpr int64_t kSliceNumel = int64_t{1} << 24;
    const int64_t n = run.master.numel();
    for (int64_t begin = 0; begin < n; begin += kSliceNumel) {
      const int64_t len = std::min(kSliceNumel, n - begin);
      at::Tensor m = run.states.at(0).narrow(0, begin, len), v = run.states.at(1).narrow(0, begin, len);
      at::Tensor m32 = m.to(at::kFloat), v32 = v.to(at::kFloat);
      fused(h, run.master.narrow(0, begin, len), g.narrow(0, begin, len), m32, v32, step_t);
      const uint32_t first = run.first_index + static_cast<uint32_t>(begin);
      narrow_to_bf16_stochastic(m32, m, run.random_key, first, DrawHalf::kLow);
      narrow_to_bf16_stochastic(v32, v, run.random_key, first, DrawHalf::kHigh);
    }
  }

 private:
  static void fused(const AdamHyper& h, const at::Tensor& master, const at::Tensor& g, const at::Tensor& m,
                    const at::Tensor& v, const at::Tensor& step_t) {
    if (h.decoupled_weight_decay) {
      at::_fused_adamw_({master}, {g}, {m}, {v}, {}, {step_t}, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps, false,
                        false);
    } else {
      at::_fused_adam_({master}, {g}, {m}, {v}, {}, {step_t}, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps, false,
                       false);
    }
  }

  std::vector<StateKind> kinds_{StateKind::kExpAvg, StateKind::kExpAvgSq};
};

}  // namespace

std::unique_ptr<OptimizerRule> make_adam_rule() { return std::make_unique<AdamRule>(); }

}  // namespace gx::torch_layer
