// CPU Adam, AVX-512 (F, BW) path (16 floats per step); see cpu_adam.h for the contract.
#include "cpu_adam.h"

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include "simd_avx512.h"

namespace gx::detail {
void cpu_adam_avx512(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end) {
  const __m512 gs = _mm512_set1_ps(c.grad_scale), wd = _mm512_set1_ps(c.weight_decay), decay = _mm512_set1_ps(c.decay);
  const __m512 omb1 = _mm512_set1_ps(c.one_minus_beta1), beta2 = _mm512_set1_ps(c.beta2);
  const __m512 omb2 = _mm512_set1_ps(c.one_minus_beta2), b2s = _mm512_set1_ps(c.bias2_sqrt);
  const __m512 eps = _mm512_set1_ps(c.eps), step = _mm512_set1_ps(c.step_size);
  auto* out16 = static_cast<uint16_t*>(b.param16);
  const bool bf16_out = b.param16_dtype == DType::kBFloat16;
  float* p_out = b.out_param();
  float* m_out = b.out_exp_avg();
  float* v_out = b.out_exp_avg_sq();
  // Out of place, the outputs are not read: non-temporal stores skip the read for ownership a
  // plain store of a line not in cache costs (12 bytes per element). They need 64-byte aligned
  // addresses: the elements before the first aligned one take the scalar path (same results).
  int64_t i = begin;
  const int64_t first = first_streamable(b, begin, end, 64, 16);
  const bool nt = first >= 0;  // else plain stores
  if (nt) {
    cpu_adam_scalar(c, b, begin, first);
    i = first;
  }
  // The 16-bit copy is never read here, in place or not: streamed wherever it is aligned.
  const bool nt16 = out16 != nullptr && reinterpret_cast<uintptr_t>(out16 + i) % 32 == 0;
  for (; i + 16 <= end; i += 16) {
    __m512 g = _mm512_mul_ps(simd_avx512::load_grad(b.grad, b.grad_dtype, i), gs);
    __m512 p = _mm512_loadu_ps(b.param + i);
    g = _mm512_fmadd_ps(wd, p, g);
    p = _mm512_mul_ps(p, decay);
    __m512 m = _mm512_loadu_ps(b.exp_avg + i);
    m = _mm512_fmadd_ps(omb1, _mm512_sub_ps(g, m), m);
    __m512 v = _mm512_fmadd_ps(omb2, _mm512_mul_ps(g, g), _mm512_mul_ps(beta2, _mm512_loadu_ps(b.exp_avg_sq + i)));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), b2s), eps);
    p = _mm512_fnmadd_ps(step, _mm512_div_ps(m, denom), p);
    if (nt) {
      _mm512_stream_ps(p_out + i, p);
      _mm512_stream_ps(m_out + i, m);
      _mm512_stream_ps(v_out + i, v);
    } else {
      _mm512_storeu_ps(p_out + i, p);
      _mm512_storeu_ps(m_out + i, m);
      _mm512_storeu_ps(v_out + i, v);
    }
    if (out16 != nullptr) {
      const __m256i h =
          bf16_out ? simd_avx512::to_bf16(p) : _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      if (nt16) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(out16 + i), h);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out16 + i), h);
      }
    }
  }
  if (nt || nt16) _mm_sfence();  // the streamed lines are visible before this range counts as done
  cpu_adam_scalar(c, b, i, end);
}

}  // namespace gx::detail

#pragma GCC pop_options
#else
namespace gx::detail {
void cpu_adam_avx512(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end) {
  cpu_adam_scalar(c, b, begin, end);  // never selected: detected_simd_isa() is scalar off x86
}
}  // namespace gx::detail
#endif
