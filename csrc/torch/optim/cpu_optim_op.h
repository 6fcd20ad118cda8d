// The CPU SGD / Lion / Adagrad kernels over torch tensors (csrc/core/kernels/cpu_optim.h): hyperparameters
// from a parameter group's name -> value map, tensors checked and reduced to raw buffers.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include "core/kernels/cpu_optim.h"
#include "torch/optim/optimizer_rule.h"

namespace gx::torch_layer {

// "sgd", "lion" or "adagrad"; UsageError naming them otherwise.
CpuOptimizer parse_cpu_optimizer(const std::string& name);

// One group's hyperparameters (the keys the Python rule writes; UsageError naming a missing one).
CpuOptimHyper cpu_optim_hyper(CpuOptimizer kind, const HyperValues& hyper, int64_t step, double grad_multiplier);

// One update, checked and reduced to raw buffers, to run later (the optimizer thread): the
// tensors' memory must stay where it is until it ran. `param16` undefined: no 16-bit copy.
struct CpuOptimWork {
  CpuOptimHyper hyper;
  CpuOptimBuffers buffers;
};
CpuOptimWork prepare_cpu_optim(const CpuOptimHyper& hyper, const at::Tensor& master,
                               const std::vector<at::Tensor>& states, const at::Tensor& grad,
                               const at::Tensor& param16);

// The op bound as _C.cpu_optim_step (tests, bench/cpu_optim.py): `out` = (param_out, state_outs...)
// writes the results there and leaves the inputs; `isa` forces an implementation.
void cpu_optim_step(const std::string& name, const at::Tensor& master, const std::vector<at::Tensor>& states,
                    const at::Tensor& grad, const std::optional<at::Tensor>& param16, int64_t step,
                    const HyperValues& hyper, double grad_scale, const std::string& isa,
                    const std::optional<std::vector<at::Tensor>>& out);

}  // namespace gx::torch_layer
