// The Adam / AdamW rule: our fused CPU Adam (csrc/core/cpu_adam.h) on the host, torch's
// _fused_adam(w)_ on the device. Hyperparameters: lr, beta1, beta2, eps, weight_decay and adamw
// (1: decoupled weight decay).
#include <ATen/TensorOperators.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/full.h>

#include "core/cpu_adam.h"
#include "core/errors.h"
#include "torch/cpu_adam_op.h"
#include "torch/optimizer_rule.h"

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
                                     grad_multiplier);
    if (spares != nullptr) {
      w.buffers.param_out = spares->master;
      w.buffers.exp_avg_out = spares->states.at(0);
      w.buffers.exp_avg_sq_out = spares->states.at(1);
      if (spares->param16 != nullptr) {
        w.buffers.param16 = spares->param16;
        w.buffers.param16_dtype = spares->param16_dtype;
      }
      check_adam_args(w.hyper, w.buffers);
    }
    return [w] { gx::cpu_adam_step(w.hyper, w.buffers); };
  }

  void device_run(const RunViews& run, int64_t step, const HyperValues& hyper,
                  double grad_multiplier) const override {
    const AdamHyper h = adam_hyper(hyper, step, grad_multiplier);
    at::Tensor g = run.grad.to(at::kFloat);
    if (grad_multiplier != 1.0) g = g.mul(grad_multiplier);
    at::Tensor step_t = at::full({}, static_cast<double>(step), run.master.options());
    if (h.decoupled_weight_decay) {
      at::_fused_adamw_({run.master}, {g}, {run.states.at(0)}, {run.states.at(1)}, {}, {step_t}, h.lr, h.beta1,
                        h.beta2, h.weight_decay, h.eps, false, false);
    } else {
      at::_fused_adam_({run.master}, {g}, {run.states.at(0)}, {run.states.at(1)}, {}, {step_t}, h.lr, h.beta1,
                       h.beta2, h.weight_decay, h.eps, false, false);
    }
  }

 private:
  std::vector<StateKind> kinds_{StateKind::kExpAvg, StateKind::kExpAvgSq};
};

}  // namespace

std::unique_ptr<OptimizerRule> make_adam_rule() { return std::make_unique<AdamRule>(); }

}  // namespace gx::torch_layer
