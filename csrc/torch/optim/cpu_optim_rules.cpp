// The SGD, Lion and Adagrad rules: our fused CPU kernels (csrc/core/kernels/cpu_optim.h) on the host,
// elementwise torch ops on the device copies (one run is one flat tensor, so a handful of
// kernel launches per run). Hyperparameters: see cpu_optim_hyper (cpu_optim_op.cpp).
#include <ATen/TensorOperators.h>
#include <ATen/ops/sign.h>

#include "core/errors.h"
#include "torch/optim/cpu_optim_op.h"
#include "torch/optim/optimizer_rule.h"

namespace gx::torch_layer {

namespace {

// g = grad * multiplier (negated for maximize) in fp32, plus weight_decay * p for SGD and Adagrad.
at::Tensor device_grad(const RunViews& run, const CpuOptimHyper& h, bool coupled_weight_decay) {
  const double scale = h.maximize ? -h.grad_scale : h.grad_scale;
  at::Tensor g = run.grad.to(at::kFloat);
  if (scale != 1.0) g = g.mul(scale);
  if (coupled_weight_decay && h.weight_decay != 0.0) g = g.add(run.master, h.weight_decay);
  return g;
}

void sgd_device(const RunViews& run, const CpuOptimHyper& h) {
  at::Tensor g = device_grad(run, h, true);
  if (h.momentum != 0.0) {
    at::Tensor buf = run.states.at(0);
    if (h.step == 1) {
      buf.copy_(g);
    } else {
      buf.mul_(h.momentum).add_(g, 1.0 - h.dampening);
    }
    g = h.nesterov ? g.add(buf, h.momentum) : buf;
  }
  run.master.add_(g, -h.lr);
}

void lion_device(const RunViews& run, const CpuOptimHyper& h) {
  const at::Tensor g = device_grad(run, h, false);
  at::Tensor m = run.states.at(0);
  const at::Tensor update = at::sign(m.mul(h.beta1).add_(g, 1.0 - h.beta1));
  if (h.weight_decay != 0.0) run.master.mul_(1.0 - h.lr * h.weight_decay);
  run.master.add_(update, -h.lr);
  m.mul_(h.beta2).add_(g, 1.0 - h.beta2);
}

void adagrad_device(const RunViews& run, const CpuOptimHyper& h) {
  const at::Tensor g = device_grad(run, h, true);
  at::Tensor sum = run.states.at(0);
  if (h.step == 1) sum.fill_(h.initial_accumulator_value);
  sum.addcmul_(g, g, 1.0);
  const double clr = h.lr / (1.0 + static_cast<double>(h.step - 1) * h.lr_decay);
  run.master.addcdiv_(g, sum.sqrt().add_(h.eps), -clr);
}

class CpuOptimRule final : public OptimizerRule {
 public:
  CpuOptimRule(CpuOptimizer kind, bool sgd_momentum) : kind_(kind) {
    switch (kind) {
      case CpuOptimizer::kSgd:
        if (sgd_momentum) kinds_ = {StateKind::kMomentumBuffer};
        break;
      case CpuOptimizer::kLion: kinds_ = {StateKind::kExpAvg}; break;
      case CpuOptimizer::kAdagrad: kinds_ = {StateKind::kSum}; break;
    }
  }

  const std::vector<StateKind>& state_kinds() const override { return kinds_; }

  std::function<void()> prepare_host_run(const RunViews& run, const RunSpares* spares, int64_t step,
                                         const HyperValues& hyper, double grad_multiplier) const override {
    const CpuOptimHyper h = checked_hyper(hyper, step, grad_multiplier);
    CpuOptimWork w = prepare_cpu_optim(h, run.master, run.states, run.grad, run.param16);
    if (spares != nullptr) {
      w.buffers.param_out = static_cast<float*>(spares->master);  // prepare_cpu_optim checked the fp32 master
      for (size_t k = 0; k < kinds_.size(); ++k) w.buffers.state_out[k] = static_cast<float*>(spares->states.at(k));
      if (spares->param16 != nullptr) {
        w.buffers.param16 = spares->param16;
        w.buffers.param16_dtype = spares->param16_dtype;
      }
      check_cpu_optim_args(w.hyper, w.buffers);
    }
    return [w] { gx::cpu_optim_step(w.hyper, w.buffers); };
  }

  bool device_run(const RunViews& run, int64_t step, const HyperValues& hyper,
                  double grad_multiplier) const override {
    const CpuOptimHyper h = checked_hyper(hyper, step, grad_multiplier);
    switch (kind_) {
      case CpuOptimizer::kSgd: sgd_device(run, h); break;
      case CpuOptimizer::kLion: lion_device(run, h); break;
      case CpuOptimizer::kAdagrad: adagrad_device(run, h); break;
    }
    return false;  // torch's kernels update the master only
  }

 private:
  // A group may not ask for momentum when the chunk sets were given no momentum buffer.
  CpuOptimHyper checked_hyper(const HyperValues& hyper, int64_t step, double grad_multiplier) const {
    const CpuOptimHyper h = cpu_optim_hyper(kind_, hyper, step, grad_multiplier);
    GX_CHECK(kind_ != CpuOptimizer::kSgd || h.momentum == 0.0 || !kinds_.empty(),
             "SGD: a param group has momentum=", h.momentum, " but the optimizer was built with momentum 0 in "
             "every group, so no momentum buffers exist. Build the optimizer with the momentum it will use.");
    return h;
  }

  CpuOptimizer kind_;
  std::vector<StateKind> kinds_;
};

}  // namespace

std::unique_ptr<OptimizerRule> make_cpu_optim_rule(const std::string& name, bool sgd_momentum) {
  return std::make_unique<CpuOptimRule>(parse_cpu_optimizer(name), sgd_momentum);
}

}  // namespace gx::torch_layer
