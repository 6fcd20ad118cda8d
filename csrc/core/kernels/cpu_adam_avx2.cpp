// CPU Adam, AVX2 + FMA + F16C path (8 floats per step); see cpu_adam.h for the contract.
#include "cpu_adam.h"

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "simd_avx2.h"

namespace gx::detail {
void cpu_adam_avx2(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end) {
  const __m256 gs = _mm256_set1_ps(c.grad_scale), wd = _mm256_set1_ps(c.weight_decay), decay = _mm256_set1_ps(c.decay);
  const __m256 omb1 = _mm256_set1_ps(c.one_minus_beta1), beta2 = _mm256_set1_ps(c.beta2);
  const __m256 omb2 = _mm256_set1_ps(c.one_minus_beta2), b2s = _mm256_set1_ps(c.bias2_sqrt);
  const __m256 eps = _mm256_set1_ps(c.eps), step = _mm256_set1_ps(c.step_size);
  auto* out16 = static_cast<uint16_t*>(b.param16);
  const bool bf16_out = b.param16_dtype == DType::kBFloat16;
  float* p_out = b.out_param();
  float* m_out = b.out_exp_avg();
  float* v_out = b.out_exp_avg_sq();
  // Out of place: non-temporal stores (see cpu_adam_avx512.cpp), from the first 32-byte
  // aligned element on.
  int64_t i = begin;
  const int64_t first = first_streamable(b, begin, end, 32, 8);
  const bool nt = first >= 0;
  if (nt) {
    cpu_adam_scalar(c, b, begin, first);
    i = first;
  }
  const bool nt16 = out16 != nullptr && reinterpret_cast<uintptr_t>(out16 + i) % 16 == 0;  // never read here
  for (; i + 8 <= end; i += 8) {
    __m256 g = _mm256_mul_ps(simd_avx2::load_grad(b.grad, b.grad_dtype, i), gs);
    __m256 p = _mm256_loadu_ps(b.param + i);
    g = _mm256_fmadd_ps(wd, p, g);
    p = _mm256_mul_ps(p, decay);
    __m256 m = _mm256_loadu_ps(b.exp_avg + i);
    m = _mm256_fmadd_ps(omb1, _mm256_sub_ps(g, m), m);
    __m256 v = _mm256_fmadd_ps(omb2, _mm256_mul_ps(g, g), _mm256_mul_ps(beta2, _mm256_loadu_ps(b.exp_avg_sq + i)));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), b2s), eps);
    p = _mm256_fnmadd_ps(step, _mm256_div_ps(m, denom), p);
    if (nt) {
      _mm256_stream_ps(p_out + i, p);
      _mm256_stream_ps(m_out + i, m);
      _mm256_stream_ps(v_out + i, v);
    } else {
      _mm256_storeu_ps(p_out + i, p);
      _mm256_storeu_ps(m_out + i, m);
      _mm256_storeu_ps(v_out + i, v);
    }
    if (out16 != nullptr) {
      const __m128i h =
          bf16_out ? simd_avx2::to_bf16(p) : _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      if (nt16) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(out16 + i), h);
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out16 + i), h);
      }
    }
  }
  if (nt || nt16) _mm_sfence();
  cpu_adam_scalar(c, b, i, end);
}

}  // namespace gx::detail

#pragma GCC pop_options
#else
namespace gx::detail {
void cpu_adam_avx2(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end) {
  cpu_adam_scalar(c, b, begin, end);  // never selected: detected_simd_isa() is scalar off x86
}
}  // namespace gx::detail
#endif
