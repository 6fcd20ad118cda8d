// Stochastic rounding of an fp32 tensor into a bf16 tensor on its own device (host memory through
// the core loop, cuda through csrc/cuda/stochastic_round_kernel.cu): the same bits either way.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "core/stochastic_round.h"

namespace gx::torch_layer {

// out[i] = float_to_bf16_stochastic(x[i], stochastic_bits(key, first_index + i) >> half); both
// contiguous, same numel and device, x float32, out bfloat16.
void narrow_to_bf16_stochastic(const at::Tensor& x, const at::Tensor& out, uint32_t key, uint32_t first_index,
                               DrawHalf half);

}  // namespace gx::torch_layer
