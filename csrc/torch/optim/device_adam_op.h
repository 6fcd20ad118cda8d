// The device Adam kernel over torch tensors (csrc/cuda/adam_kernel.h): validation of devices,
// dtypes and layout, then one launch on the tensors' device's current stream.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "core/kernels/cpu_adam.h"

namespace gx::torch_layer {

// Updates `param` (fp32), `exp_avg`, `exp_avg_sq` (both fp32 or both bf16) in place from `grad`
// (fp32/bf16/fp16) and, when given, writes the updated param into `param16` (bf16/fp16); all
// contiguous CUDA tensors of one device and one numel. The result equals cpu_adam_step's on the
// same values bit for bit (bf16 moments rounded with the bits of (random_key, first_index + i)).
// UsageError on a build without CUDA.
void device_adam_step(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                      const at::Tensor& grad, const std::optional<at::Tensor>& param16, const AdamHyper& hyper,
                      uint32_t random_key, uint32_t first_index, int max_blocks = 0);

// The device kernel's block cap for the optimizer's link lane (cuda/adam_kernel.h's max_blocks).
inline constexpr int kLinkLaneBlocks = 32;

}  // namespace gx::torch_layer
