#include "torch/optim/cpu_optim_op.h"

#include "core/errors.h"
#include "torch/optim/cpu_kernel_args.h"
#include "torch/dtype_map.h"

namespace gx::torch_layer {

CpuOptimizer parse_cpu_optimizer(const std::string& name) {
  for (CpuOptimizer k : {CpuOptimizer::kSgd, CpuOptimizer::kLion, CpuOptimizer::kAdagrad})
    if (name == to_string(k)) return k;
  GX_CHECK(false, "cpu optimizer: expected 'sgd', 'lion' or 'adagrad', got '", name, "'.");
}

CpuOptimHyper cpu_optim_hyper(CpuOptimizer kind, const HyperValues& h, int64_t step, double grad_multiplier) {
  const char* rule = to_string(kind);
  CpuOptimHyper out;
  out.kind = kind;
  out.step = step;
  out.grad_scale = grad_multiplier;
  out.lr = hyper_value(h, "lr", rule);
  out.weight_decay = hyper_value(h, "weight_decay", rule);
  switch (kind) {
    case CpuOptimizer::kSgd:
      out.momentum = hyper_value(h, "momentum", rule);
      out.dampening = hyper_value(h, "dampening", rule);
      out.nesterov = hyper_value(h, "nesterov", rule) != 0.0;
      out.maximize = hyper_value(h, "maximize", rule) != 0.0;
      break;
    case CpuOptimizer::kLion:
      out.beta1 = hyper_value(h, "beta1", rule);
      out.beta2 = hyper_value(h, "beta2", rule);
      break;
    case CpuOptimizer::kAdagrad:
      out.lr_decay = hyper_value(h, "lr_decay", rule);
      out.eps = hyper_value(h, "eps", rule);
      out.initial_accumulator_value = hyper_value(h, "initial_accumulator_value", rule);
      out.maximize = hyper_value(h, "maximize", rule) != 0.0;
      break;
  }
  return out;
}

CpuOptimWork prepare_cpu_optim(const CpuOptimHyper& hyper, const at::Tensor& master,
                               const std::vector<at::Tensor>& states, const at::Tensor& grad,
                               const at::Tensor& param16) {
  const char* op = to_string(hyper.kind);
  const int64_t n = master.numel();
  const int needed = num_states(hyper.kind, hyper.momentum != 0.0);
  GX_CHECK(static_cast<int>(states.size()) >= needed, op, ": expected ", needed, " state tensor(s), got ",
           states.size(), (hyper.kind == CpuOptimizer::kSgd ? " (momentum needs a momentum_buffer)" : ""), ".");
  GX_CHECK(master.scalar_type() == at::kFloat, op, ": param (the master) must be float32, got ",
           c10::toString(master.scalar_type()), ".");
  check_cpu_tensor(master, op, "param", n);
  check_cpu_tensor(grad, op, "grad", n);
  CpuOptimBuffers b;
  b.param = master.data_ptr<float>();
  for (int k = 0; k < needed; ++k) {
    GX_CHECK(states[static_cast<size_t>(k)].scalar_type() == at::kFloat, op, ": state tensors must be float32.");
    check_cpu_tensor(states[static_cast<size_t>(k)], op, "state", n);
    b.state[k] = states[static_cast<size_t>(k)].data_ptr<float>();
  }
  b.grad = grad.data_ptr();
  b.grad_dtype = to_gx_dtype(grad.scalar_type());
  b.numel = n;
  if (param16.defined()) {
    check_cpu_tensor(param16, op, "param16", n);
    b.param16 = param16.data_ptr();
    b.param16_dtype = to_gx_dtype(param16.scalar_type());
  }
  check_cpu_optim_args(hyper, b);
  return CpuOptimWork{hyper, b};
}

void cpu_optim_step(const std::string& name, const at::Tensor& master, const std::vector<at::Tensor>& states,
                    const at::Tensor& grad, const std::optional<at::Tensor>& param16, int64_t step,
                    const HyperValues& hyper, double grad_scale, const std::string& isa,
                    const std::optional<std::vector<at::Tensor>>& out) {
  const CpuOptimizer kind = parse_cpu_optimizer(name);
  const SimdIsa simd = parse_simd_isa(isa, "cpu_optim_step");
  CpuOptimWork w = prepare_cpu_optim(cpu_optim_hyper(kind, hyper, step, grad_scale), master, states, grad,
                                     param16.has_value() ? *param16 : at::Tensor());
  if (out.has_value()) {
    const size_t needed = 1 + static_cast<size_t>(num_states(kind, w.hyper.momentum != 0.0));
    GX_CHECK(out->size() == needed, "cpu_optim_step out: expected ", needed, " tensors (param_out, then one per "
             "state), got ", out->size(), ".");
    for (const at::Tensor& t : *out) {
      GX_CHECK(t.scalar_type() == at::kFloat, "cpu_optim_step: out tensors must be float32.");
      check_cpu_tensor(t, "cpu_optim_step", "out", master.numel());
    }
    w.buffers.param_out = (*out)[0].data_ptr<float>();
    for (size_t k = 1; k < needed; ++k) w.buffers.state_out[k - 1] = (*out)[k].data_ptr<float>();
  }
  gx::cpu_optim_step(w.hyper, w.buffers, simd);
}

}  // namespace gx::torch_layer
