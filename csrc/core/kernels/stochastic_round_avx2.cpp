// Widening bf16 and stochastic rounding to bf16, AVX2 path (8 lanes); see stochastic_round.h.
#include "stochastic_round.h"

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "simd_avx2.h"

namespace gx::detail {
namespace round_avx2 {
#include "stochastic_round_kernels.inc"
}  // namespace round_avx2

void widen_bf16_avx2(const uint16_t* in, float* out, int64_t n) {
  const int64_t i = round_avx2::widen_bf16_body<simd_avx2::Vec>(in, out, n);
  widen_bf16_scalar(in + i, out + i, n - i);
}

void narrow_pair_bf16_stochastic_avx2(const float* a, const float* b, uint16_t* a_out, uint16_t* b_out, int64_t n,
                                      uint32_t key, uint32_t first_index) {
  const int64_t i = round_avx2::narrow_pair_body<simd_avx2::Vec>(a, b, a_out, b_out, n, key, first_index);
  narrow_pair_bf16_stochastic_scalar(a + i, b + i, a_out + i, b_out + i, n - i, key,
                                     first_index + static_cast<uint32_t>(i));
}

}  // namespace gx::detail

#pragma GCC pop_options
#else
namespace gx::detail {
void widen_bf16_avx2(const uint16_t* in, float* out, int64_t n) { widen_bf16_scalar(in, out, n); }
void narrow_pair_bf16_stochastic_avx2(const float* a, const float* b, uint16_t* a_out, uint16_t* b_out, int64_t n,
                                      uint32_t key, uint32_t first_index) {
  narrow_pair_bf16_stochastic_scalar(a, b, a_out, b_out, n, key, first_index);  // never selected off x86
}
}  // namespace gx::detail
#endif
