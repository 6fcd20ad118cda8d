// Adam with bf16 moments, AVX-512 path (16 lanes); see cpu_adam_bf16_moments.h.
#include "cpu_adam_bf16_moments.h"
#include "stochastic_round.h"

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include "simd_avx512.h"

namespace gx::detail {
namespace bf16_moments_avx512 {
#include "stochastic_round_kernels.inc"
#include "cpu_adam_bf16_moments_kernels.inc"
}  // namespace bf16_moments_avx512

void adam_bf16_moments_avx512(const AdamConstants& c, const AdamBuffers& b, const Bf16Moments& mo, int64_t begin,
                              int64_t end) {
  const int64_t done = bf16_moments_avx512::adam_bf16_moments_any<simd_avx512::Vec>(
      c, buffers_from(b, begin, end - begin), moments_from(mo, begin), end - begin);
  adam_bf16_moments_scalar(c, b, mo, begin + done, end);
}

}  // namespace gx::detail

#pragma GCC pop_options
#else
namespace gx::detail {
void adam_bf16_moments_avx512(const AdamConstants& c, const AdamBuffers& b, const Bf16Moments& mo, int64_t begin,
                              int64_t end) {
  adam_bf16_moments_scalar(c, b, mo, begin, end);  // never selected off x86
}
}  // namespace gx::detail
#endif
