// The CPU Adam kernel over torch tensors: validation of devices, dtypes, shapes and layout, then
// one call of the core kernel (csrc/core/kernels/cpu_adam.h) over the host thread pool.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include "core/kernels/cpu_adam.h"
#include "core/kernels/cpu_adam_bf16_moments.h"

namespace gx::torch_layer {

// The hyperparameters of one step as the ops take them (`step`: the count after this update).
AdamHyper adam_hyper_of(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                        bool adamw, double grad_scale);

// Updates `param` (fp32), `exp_avg`, `exp_avg_sq` in place from `grad` (fp32/bf16/fp16) and, when
// given, writes the updated param into `param16` (bf16/fp16). All CPU, contiguous, same numel.
// The moments are fp32, or both bf16: then they are stochastically rounded with the bits of
// (`random_key`, `first_index` + i) (core/kernels/cpu_adam_bf16_moments.h).
// `isa` ("scalar", "avx2", "avx512") forces an implementation; empty: the best available.
// One CPU Adam update, checked and reduced to raw buffers, to run later (the offload pipeline's
// optimizer thread): the tensors' memory must stay where it is until it ran.
struct CpuAdamWork {
  AdamHyper hyper;
  AdamBuffers buffers;                 // bf16 moments: its fp32 moment fields stay null
  std::optional<Bf16Moments> moments;  // set when the moments are bf16
  void check() const;                  // after setting out-of-place buffers
  void run(SimdIsa isa) const;
};
CpuAdamWork prepare_cpu_adam(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                             const at::Tensor& grad, const std::optional<at::Tensor>& param16, const AdamHyper& hyper,
                             uint32_t random_key = 0, uint32_t first_index = 0);

// out: optional (param_out, exp_avg_out, exp_avg_sq_out), all three or none: out of place.
void cpu_adam_step(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                   const at::Tensor& grad, const std::optional<at::Tensor>& param16, int64_t step, double lr,
                   double beta1, double beta2, double eps, double weight_decay, bool adamw, double grad_scale,
                   const std::string& isa, const std::optional<std::vector<at::Tensor>>& out = std::nullopt,
                   int64_t random_key = 0, int64_t first_index = 0);

}  // namespace gx::torch_layer
