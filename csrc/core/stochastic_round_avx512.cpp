// Widening bf16 and stochastic rounding to bf16, AVX-512 path (16 lanes); see stochastic_round.h.
#include "stochastic_round.h"

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include "simd_avx512.h"

namespace gx::detail {
namespace {

inline __m512i mix32_avx512(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bU)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// float_to_bf16_stochastic per lane, `draw` < 2^16: the rounded 16-bit value in each 32-bit lane.
inline __m512i round_lanes(__m512 v, __m512i draw) {
  const __m512i exponent = _mm512_set1_epi32(0x7f800000);
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, draw), 16);
  const __mmask16 nonfinite = _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits, exponent), exponent);
  if (nonfinite == 0) return rounded;  // the common case: no inf or NaN among the 16
  return _mm512_mask_mov_epi32(rounded, nonfinite, simd_avx512::to_bf16_lanes(v));
}

}  // namespace

void widen_bf16_avx512(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
  for (; i < n; ++i) out[i] = bf16_to_float(in[i]);
}

void narrow_pair_bf16_stochastic_avx512(const float* a, const float* b, uint16_t* a_out, uint16_t* b_out, int64_t n,
                                        uint32_t key, uint32_t first_index) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i k = _mm512_set1_epi32(static_cast<int>(key));
  const __m512i low16 = _mm512_set1_epi32(0xffff);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i start = _mm512_set1_epi32(static_cast<int>(first_index + static_cast<uint32_t>(i)));
    const __m512i bits = mix32_avx512(_mm512_xor_si512(_mm512_add_epi32(start, lane), k));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a_out + i),
                        _mm512_cvtepi32_epi16(round_lanes(_mm512_loadu_ps(a + i), _mm512_and_si512(bits, low16))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(b_out + i),
                        _mm512_cvtepi32_epi16(round_lanes(_mm512_loadu_ps(b + i), _mm512_srli_epi32(bits, 16))));
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
void widen_bf16_avx512(const uint16_t* in, float* out, int64_t n) { widen_bf16_scalar(in, out, n); }
void narrow_pair_bf16_stochastic_avx512(const float* a, const float* b, uint16_t* a_out, uint16_t* b_out, int64_t n,
                                      uint32_t key, uint32_t first_index) {
  narrow_pair_bf16_stochastic_scalar(a, b, a_out, b_out, n, key, first_index);  // never selected off x86
}
}  // namespace gx::detail
#endif
