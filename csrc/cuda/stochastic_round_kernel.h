// Stochastic rounding of an fp32 device buffer to bf16: the device side of
// csrc/core/stochastic_round.h (the same inline functions, so the bits are the CPU path's).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace gx {

// out[i] = float_to_bf16_stochastic(x[i], stochastic_bits(key, first_index + i) >> draw_shift)
// (draw_shift 0 or 16: core/stochastic_round.h's DrawHalf), launched on `stream` (asynchronous);
// both buffers on the current device.
void narrow_to_bf16_stochastic_on_device(const float* x, uint16_t* out, int64_t n, uint32_t key,
                                         uint32_t first_index, int draw_shift, cudaStream_t stream);

}  // namespace gx
