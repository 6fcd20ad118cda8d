// AVX-512 (F, BW) building blocks shared by the CPU optimizer kernels (16 floats per vector).
//
// Design note. Include this only after `#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")`
// in a file whose kernels are picked at run time (cpu_features.h). Conversions round to nearest
// even exactly as half_convert.h does.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "core/types.h"

namespace gx::simd_avx512 {

// 16 gradient elements (fp32, bf16 or fp16) as floats.
inline __m512 load_grad(const void* grad, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBFloat16: {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case DType::kFloat16:
      return _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i)));
    default: return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
  }
}

// Round to nearest even, NaN to quiet NaN: the same bits as float_to_bf16, one per 32-bit lane.
inline __m512i to_bf16_lanes(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i out = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __m512i abs = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_mov_epi32(out, is_nan, _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40)));
}

inline __m256i to_bf16(__m512 x) { return _mm512_cvtepi32_epi16(to_bf16_lanes(x)); }

inline __m256i to_half(__m512 x, DType dtype) {
  return dtype == DType::kBFloat16 ? to_bf16(x) : _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// The vector type the optimizer kernel templates (cpu_optim_kernels.inc) are written against.
struct Vec {
  using F = __m512;
  static constexpr int64_t kWidth = 16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F grad(const void* g, DType dtype, int64_t i) { return load_grad(g, dtype, i); }
  static void store16(void* out, DType dtype, int64_t i, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), to_half(x, dtype));
  }
  // Non-temporal stores (the line is written without being read first): `p` aligned to
  // kStreamAlignBytes, the 16-bit copy's address to half that; fence() orders them before what follows.
  static constexpr size_t kStreamAlignBytes = 64;
  static void stream(float* p, F x) { _mm512_stream_ps(p, x); }
  static void stream16(void* out, DType dtype, int64_t i, F x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), to_half(x, dtype));
  }
  static void fence() { _mm_sfence(); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  // Lane masks, for kernels that pick per element (adam_correction_kernels.inc).
  using M = __mmask16;
  static M eq(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static M both(M a, M b) { return static_cast<M>(a & b); }
  static M all_lanes() { return static_cast<M>(0xFFFF); }
  static F select(M m, F if_true, F if_false) { return _mm512_mask_blend_ps(m, if_false, if_true); }
  // +1 where x > 0, -1 where x < 0, x itself otherwise (+-0 and NaN), as torch.sign.
  static F sign(F x) {
    const F zero = _mm512_setzero_ps();
    F out = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ), _mm512_set1_ps(1.0f));
    return _mm512_mask_mov_ps(out, _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), _mm512_set1_ps(-1.0f));
  }
  // 32-bit integer lanes, for bf16 widening and stochastic rounding (stochastic_round_kernels.inc).
  using I = __m512i;
  static F widen16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static I index_lanes(uint32_t first) {
    return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  static I xor_key(I x, uint32_t key) { return _mm512_xor_si512(x, _mm512_set1_epi32(static_cast<int>(key))); }
  static I mix32(I x) {  // stochastic_round.h's mix32 per lane
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bU)));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  }
  static I low16(I x) { return _mm512_and_si512(x, _mm512_set1_epi32(0xffff)); }
  static I high16(I x) { return _mm512_srli_epi32(x, 16); }
  // float_to_bf16_stochastic per lane (`draw` < 2^16), the 16-bit results in 32-bit lanes.
  static I round_stochastic(F v, I draw) {
    const __m512i exponent = _mm512_set1_epi32(0x7f800000);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, draw), 16);
    const __mmask16 nonfinite = _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits, exponent), exponent);
    if (nonfinite == 0) return rounded;  // the common case: no inf or NaN among the lanes
    return _mm512_mask_mov_epi32(rounded, nonfinite, to_bf16_lanes(v));
  }
  static void store_lanes16(uint16_t* p, I lanes) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(lanes));
  }
};

}  // namespace gx::simd_avx512
