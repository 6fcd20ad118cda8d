// AVX2 + FMA + F16C building blocks shared by the CPU optimizer kernels (8 floats per vector).
//
// Design note. Include this only after `#pragma GCC target("avx2,fma,f16c")` in a file whose
// kernels are picked at run time (cpu_features.h): the functions are compiled for that target.
// Conversions round to nearest even exactly as half_convert.h does, so a kernel written with
// these matches its scalar twin bit for bit.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "core/types.h"

namespace gx::simd_avx2 {

// 8 gradient elements (fp32, bf16 or fp16) as floats.
inline __m256 load_grad(const void* grad, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBFloat16: {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case DType::kFloat16:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i)));
    default: return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  }
}

// Round to nearest even, NaN to quiet NaN: the same bits as float_to_bf16, one per 32-bit lane.
inline __m256i to_bf16_lanes(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i out = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i abs = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7F800000));
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(out, nan, is_nan);
}

// 8 lanes of 16-bit values (each lane < 2^16) packed into 8 uint16.
inline __m128i pack_lanes(__m256i lanes) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lanes, lanes), 0x08);  // qwords 0 and 2
  return _mm256_castsi256_si128(packed);
}

inline __m128i to_bf16(__m256 x) { return pack_lanes(to_bf16_lanes(x)); }

inline __m128i to_half(__m256 x, DType dtype) {
  return dtype == DType::kBFloat16 ? to_bf16(x) : _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// The vector type the optimizer kernel templates (cpu_optim_kernels.inc) are written against.
struct Vec {
  using F = __m256;
  static constexpr int64_t kWidth = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F grad(const void* g, DType dtype, int64_t i) { return load_grad(g, dtype, i); }
  static void store16(void* out, DType dtype, int64_t i, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), to_half(x, dtype));
  }
  // Non-temporal stores (the line is written without being read first): `p` aligned to
  // kStreamAlignBytes, the 16-bit copy's address to half that; fence() orders them before what follows.
  static constexpr size_t kStreamAlignBytes = 32;
  static void stream(float* p, F x) { _mm256_stream_ps(p, x); }
  static void stream16(void* out, DType dtype, int64_t i, F x) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), to_half(x, dtype));
  }
  static void fence() { _mm_sfence(); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c, one rounding
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  // Lane masks, for kernels that pick per element (adam_correction_kernels.inc).
  using M = __m256;
  static M eq(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
  static M both(M a, M b) { return _mm256_and_ps(a, b); }
  static M all_lanes() { return _mm256_castsi256_ps(_mm256_set1_epi32(-1)); }
  static F select(M m, F if_true, F if_false) { return _mm256_blendv_ps(if_false, if_true, m); }
  // +1 where x > 0, -1 where x < 0, x itself otherwise (+-0 and NaN), as torch.sign.
  static F sign(F x) {
    const F zero = _mm256_setzero_ps();
    F out = _mm256_blendv_ps(x, _mm256_set1_ps(1.0f), _mm256_cmp_ps(x, zero, _CMP_GT_OQ));
    return _mm256_blendv_ps(out, _mm256_set1_ps(-1.0f), _mm256_cmp_ps(x, zero, _CMP_LT_OQ));
  }
  // 32-bit integer lanes, for bf16 widening and stochastic rounding (stochastic_round_kernels.inc).
  using I = __m256i;
  static F widen16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static I index_lanes(uint32_t first) {
    return _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static I xor_key(I x, uint32_t key) { return _mm256_xor_si256(x, _mm256_set1_epi32(static_cast<int>(key))); }
  static I mix32(I x) {  // stochastic_round.h's mix32 per lane
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bU)));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  }
  static I low16(I x) { return _mm256_and_si256(x, _mm256_set1_epi32(0xffff)); }
  static I high16(I x) { return _mm256_srli_epi32(x, 16); }
  // float_to_bf16_stochastic per lane (`draw` < 2^16), the 16-bit results in 32-bit lanes.
  static I round_stochastic(F v, I draw) {
    const __m256i exponent = _mm256_set1_epi32(0x7f800000);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, draw), 16);
    const __m256i nonfinite = _mm256_cmpeq_epi32(_mm256_and_si256(bits, exponent), exponent);
    if (_mm256_testz_si256(nonfinite, nonfinite)) return rounded;  // the common case: no inf or NaN
    return _mm256_blendv_epi8(rounded, to_bf16_lanes(v), nonfinite);
  }
  static void store_lanes16(uint16_t* p, I lanes) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), pack_lanes(lanes));
  }
};

}  // namespace gx::simd_avx2
