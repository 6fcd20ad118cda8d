#include "cuda/stochastic_round_kernel.h"

#include "core/stochastic_round.h"
#include "cuda/cuda_backend.h"

namespace gx {
namespace {

__global__ void narrow_kernel(const float* x, uint16_t* out, int64_t n, uint32_t key, uint32_t first_index,
                              int draw_shift) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint32_t index = first_index + static_cast<uint32_t>(i);
    out[i] = float_to_bf16_stochastic(x[i], stochastic_bits(key, index) >> draw_shift);
  }
}

}  // namespace

void narrow_to_bf16_stochastic_on_device(const float* x, uint16_t* out, int64_t n, uint32_t key,
                                         uint32_t first_index, int draw_shift, cudaStream_t stream) {
  if (n == 0) return;
  constexpr int kThreads = 256;
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < 65536 ? wanted : 65536);
  narrow_kernel<<<blocks, kThreads, 0, stream>>>(x, out, n, key, first_index, draw_shift);
  GX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gx
