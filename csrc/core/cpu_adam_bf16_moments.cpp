#include "cpu_adam_bf16_moments.h"

#include <algorithm>

#include "errors.h"
#include "half_convert.h"
#include "stochastic_round.h"
#include "thread_pool.h"

namespace gx {
namespace {

const void* offset_16_or_32(const void* base, DType dtype, int64_t elements) {
  const size_t itemsize = dtype == DType::kFloat32 ? 4 : 2;
  return static_cast<const char*>(base) + static_cast<size_t>(elements) * itemsize;
}

}  // namespace

void check_adam_bf16_moments_args(const AdamHyper& hyper, const AdamBuffers& b, const Bf16Moments& m) {
  GX_CHECK(b.exp_avg == nullptr && b.exp_avg_sq == nullptr && b.exp_avg_out == nullptr && b.exp_avg_sq_out == nullptr,
           "Adam with bf16 moments: the fp32 moment buffers must be unset (the moments come as bf16).");
  GX_CHECK(b.numel <= (int64_t{1} << 32) - m.first_index, "Adam with bf16 moments: ", b.numel,
           " elements from index ", m.first_index, " exceed one random stream (2^32 elements).");
  if (b.numel == 0) return;
  GX_CHECK(m.exp_avg != nullptr && m.exp_avg_sq != nullptr, "Adam with bf16 moments: exp_avg and exp_avg_sq must be "
           "set.");
  GX_CHECK((m.exp_avg_out == nullptr) == (m.exp_avg_sq_out == nullptr) &&
               (m.exp_avg_out == nullptr) == (b.param_out == nullptr),
           "Adam with bf16 moments: param_out, exp_avg_out and exp_avg_sq_out must be set together (out of place) or "
           "not at all.");
  AdamBuffers probe = b;  // the shared checks, with stand-ins for the fp32 moments
  float stand_in = 0.0f;
  probe.exp_avg = probe.exp_avg_sq = &stand_in;
  if (b.param_out != nullptr) probe.exp_avg_out = probe.exp_avg_sq_out = &stand_in;
  check_adam_args(hyper, probe);
}

void cpu_adam_step_bf16_moments(const AdamHyper& hyper, const AdamBuffers& buffers, const Bf16Moments& moments,
                                SimdIsa isa) {
  check_adam_bf16_moments_args(hyper, buffers, moments);
  GX_CHECK(static_cast<int>(isa) <= static_cast<int>(detected_simd_isa()), "cpu_adam_step: ISA ", to_string(isa),
           " requested but this CPU supports at most ", to_string(detected_simd_isa()), ".");
  if (buffers.numel == 0) return;
  const AdamConstants c = adam_constants(hyper);
  constexpr int64_t kGrainBlocks = (int64_t{1} << 16) / kBf16MomentsBlockNumel;  // 64 Ki elements per thread at least
  const int64_t blocks = (buffers.numel + kBf16MomentsBlockNumel - 1) / kBf16MomentsBlockNumel;
  ThreadPool::global().parallel_for(blocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    alignas(64) float m[kBf16MomentsBlockNumel];
    alignas(64) float v[kBf16MomentsBlockNumel];
    for (int64_t block = b0; block < b1; ++block) {
      const int64_t begin = block * kBf16MomentsBlockNumel;
      const int64_t n = std::min(kBf16MomentsBlockNumel, buffers.numel - begin);
      widen_bf16(moments.exp_avg + begin, m, n, isa);
      widen_bf16(moments.exp_avg_sq + begin, v, n, isa);
      AdamBuffers part;
      part.param = buffers.param + begin;
      part.exp_avg = m;
      part.exp_avg_sq = v;
      part.grad = offset_16_or_32(buffers.grad, buffers.grad_dtype, begin);
      part.grad_dtype = buffers.grad_dtype;
      if (buffers.param16 != nullptr) {
        part.param16 = const_cast<void*>(offset_16_or_32(buffers.param16, buffers.param16_dtype, begin));
        part.param16_dtype = buffers.param16_dtype;
      }
      part.numel = n;
      if (buffers.param_out != nullptr) {  // the master out of place; the scratch is private anyway
        part.param_out = buffers.param_out + begin;
        part.exp_avg_out = m;
        part.exp_avg_sq_out = v;
      }
      cpu_adam_range(c, part, 0, n, isa);
      uint16_t* m_out = (moments.exp_avg_out != nullptr ? moments.exp_avg_out : moments.exp_avg) + begin;
      uint16_t* v_out = (moments.exp_avg_sq_out != nullptr ? moments.exp_avg_sq_out : moments.exp_avg_sq) + begin;
      narrow_pair_bf16_stochastic(m, v, m_out, v_out, n, moments.key, moments.first_index + static_cast<uint32_t>(begin),
                                  isa);
    }
  });
}

void cpu_adam_step_bf16_moments(const AdamHyper& hyper, const AdamBuffers& buffers, const Bf16Moments& moments) {
  cpu_adam_step_bf16_moments(hyper, buffers, moments, best_simd_isa());
}

}  // namespace gx
