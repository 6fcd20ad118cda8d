#include "stochastic_round.h"

#include "core/errors.h"
#include "core/thread_pool.h"

namespace gx {

namespace detail {

void widen_bf16_scalar(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(in[i]);
}

void narrow_param_bf16_stochastic_scalar(const float* x, uint16_t* out, int64_t n, uint32_t key, uint32_t first_index) {
  const uint32_t param_key = param_stream_key(key);
  for (int64_t i = 0; i < n; ++i)
    out[i] = float_to_bf16_stochastic(x[i], stochastic_bits(param_key, first_index + static_cast<uint32_t>(i)));
}

void narrow_pair_bf16_stochastic_scalar(const float* a, const float* b, uint16_t* a_out, uint16_t* b_out, int64_t n,
                                        uint32_t key, uint32_t first_index) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = stochastic_bits(key, first_index + static_cast<uint32_t>(i));
    a_out[i] = float_to_bf16_stochastic(a[i], bits);
    b_out[i] = float_to_bf16_stochastic(b[i], bits >> 16);
  }
}

}  // namespace detail

void widen_bf16(const uint16_t* in, float* out, int64_t n, SimdIsa isa) {
  switch (isa) {
    case SimdIsa::kAvx512: detail::widen_bf16_avx512(in, out, n); return;
    case SimdIsa::kAvx2: detail::widen_bf16_avx2(in, out, n); return;
    case SimdIsa::kScalar: detail::widen_bf16_scalar(in, out, n); return;
  }
  GX_INTERNAL_ASSERT(false, "unknown SimdIsa");
}

void narrow_pair_bf16_stochastic(const float* a, const float* b, uint16_t* a_out, uint16_t* b_out, int64_t n,
                                 uint32_t key, uint32_t first_index, SimdIsa isa) {
  switch (isa) {
    case SimdIsa::kAvx512: detail::narrow_pair_bf16_stochastic_avx512(a, b, a_out, b_out, n, key, first_index); return;
    case SimdIsa::kAvx2: detail::narrow_pair_bf16_stochastic_avx2(a, b, a_out, b_out, n, key, first_index); return;
    case SimdIsa::kScalar: detail::narrow_pair_bf16_stochastic_scalar(a, b, a_out, b_out, n, key, first_index); return;
  }
  GX_INTERNAL_ASSERT(false, "unknown SimdIsa");
}

void narrow_to_bf16_stochastic(const float* x, uint16_t* out, int64_t n, uint32_t key, uint32_t first_index,
                               DrawHalf half) {
  constexpr int64_t kGrainNumel = int64_t{1} << 16;
  const int shift = static_cast<int>(half);
  ThreadPool::global().parallel_for(n, kGrainNumel, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t bits = stochastic_bits(key, first_index + static_cast<uint32_t>(i));
      out[i] = float_to_bf16_stochastic(x[i], bits >> shift);
    }
  });
}

}  // namespace gx
