// Widening bf16 and stochastic rounding to bf16, AVX2 path (8 lanes); see stochastic_round.h.
#include "stochastic_round.h"

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "simd_avx2.h"

namespace gx::detail {
namespace {

inline __m256i mix32_avx2(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bU)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// float_to_bf16_stochastic per lane, `draw` < 2^16: the rounded 16-bit value in each 32-bit lane.
inline __m256i round_lanes(__m256 v, __m256i draw) {
  const __m256i exponent = _mm256_set1_epi32(0x7f800000);
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, draw), 16);
  const __m256i nonfinite = _mm256_cmpeq_epi32(_mm256_and_si256(bits, exponent), exponent);
  if (_mm256_testz_si256(nonfinite, nonfinite)) return rounded;  // the common case: no inf or NaN among the 8
  return _mm256_blendv_epi8(rounded, simd_avx2::to_bf16_lanes(v), nonfinite);
}

}  // namespace

void widen_bf16_avx2(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  for (; i < n; ++i) out[i] = bf16_to_float(in[i]);
}

void narrow_pair_bf16_stochastic_avx2(const float* a, const float* b, uint16_t* a_out, uint16_t* b_out, int64_t n,
                                      uint32_t key, uint32_t first_index) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i k = _mm256_set1_epi32(static_cast<int>(key));
  const __m256i low16 = _mm256_set1_epi32(0xffff);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i start = _mm256_set1_epi32(static_cast<int>(first_index + static_cast<uint32_t>(i)));
    const __m256i bits = mix32_avx2(_mm256_xor_si256(_mm256_add_epi32(start, lane), k));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a_out + i),
                     simd_avx2::pack_lanes(round_lanes(_mm256_loadu_ps(a + i), _mm256_and_si256(bits, low16))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b_out + i),
                     simd_avx2::pack_lanes(round_lanes(_mm256_loadu_ps(b + i), _mm256_srli_epi32(bits, 16))));
  }
  for (; i < n; ++i) {
    const uint32_t bits = stochastic_bits(key, first_index + static_cast<uint32_t>(i));
    a_out[i] = float_to_bf16_stochastic(a[i], bits);
    b_out[i] = float_to_bf16_stochastic(b[i], bits >> 16);
  }
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
