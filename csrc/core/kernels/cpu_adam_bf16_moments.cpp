#include "cpu_adam_bf16_moments.h"

#include <algorithm>

#include "core/errors.h"
#include "half_convert.h"
#include "stochastic_round.h"
#include "core/thread_pool.h"

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
  const bool bf16_param = m.param != nullptr;
  GX_CHECK(!bf16_param || (b.param == nullptr && b.param_out == nullptr && b.param16 == nullptr),
           "Adam with bf16 moments: a bf16 master (moments.param) replaces the fp32 one; param, param_out and "
           "param16 of the buffers must be unset with it.");
  GX_CHECK(bf16_param || m.param_out == nullptr, "Adam with bf16 moments: moments.param_out is set without a bf16 "
           "master (moments.param).");
  const bool param_out = bf16_param ? m.param_out != nullptr : b.param_out != nullptr;
  GX_CHECK((m.exp_avg_out == nullptr) == (m.exp_avg_sq_out == nullptr) && (m.exp_avg_out == nullptr) == !param_out,
           "Adam with bf16 moments: param_out, exp_avg_out and exp_avg_sq_out must be set together (out of place) or "
           "not at all.");
  AdamBuffers probe = b;  // the shared checks, with stand-ins for the fp32 moments (and a bf16 master)
  float stand_in = 0.0f;
  probe.exp_avg = probe.exp_avg_sq = &stand_in;
  if (bf16_param) probe.param = &stand_in;
  if (param_out) probe.exp_avg_out = probe.exp_avg_sq_out = probe.param_out = &stand_in;
  check_adam_args(hyper, probe);
}

namespace detail {

AdamBuffers buffers_from(const AdamBuffers& b, int64_t begin, int64_t n) {
  AdamBuffers part;
  if (b.param != nullptr) part.param = b.param + begin;
  part.grad = offset_16_or_32(b.grad, b.grad_dtype, begin);
  part.grad_dtype = b.grad_dtype;
  if (b.param16 != nullptr) {
    part.param16 = const_cast<void*>(offset_16_or_32(b.param16, b.param16_dtype, begin));
    part.param16_dtype = b.param16_dtype;
  }
  if (b.param_out != nullptr) part.param_out = b.param_out + begin;
  part.numel = n;
  return part;
}

Bf16Moments moments_from(const Bf16Moments& m, int64_t begin) {
  Bf16Moments part = m;
  part.exp_avg += begin;
  part.exp_avg_sq += begin;
  if (m.exp_avg_out != nullptr) {
    part.exp_avg_out += begin;
    part.exp_avg_sq_out += begin;
  }
  if (m.param != nullptr) part.param += begin;
  if (m.param_out != nullptr) part.param_out += begin;
  part.first_index = m.first_index + static_cast<uint32_t>(begin);
  return part;
}

void adam_bf16_moments_scalar(const AdamConstants& c, const AdamBuffers& b, const Bf16Moments& mo, int64_t begin,
                              int64_t end) {
  alignas(64) float m[kBf16MomentsBlockNumel];
  alignas(64) float v[kBf16MomentsBlockNumel];
  alignas(64) float p[kBf16MomentsBlockNumel];  // a bf16 master's block, widened
  for (int64_t start = begin; start < end; start += kBf16MomentsBlockNumel) {
    const int64_t n = std::min(kBf16MomentsBlockNumel, end - start);
    const Bf16Moments part_m = moments_from(mo, start);
    widen_bf16_scalar(part_m.exp_avg, m, n);
    widen_bf16_scalar(part_m.exp_avg_sq, v, n);
    AdamBuffers part = buffers_from(b, start, n);
    part.exp_avg = m;
    part.exp_avg_sq = v;
    if (part_m.param != nullptr) {  // in place in the private scratch, narrowed below
      widen_bf16_scalar(part_m.param, p, n);
      part.param = p;
    } else if (part.param_out != nullptr) {  // the master out of place; the scratch is private anyway
      part.exp_avg_out = m;
      part.exp_avg_sq_out = v;
    }
    cpu_adam_scalar(c, part, 0, n);
    if (part_m.param != nullptr)
      narrow_param_bf16_stochastic_scalar(p, part_m.param_out != nullptr ? part_m.param_out : part_m.param, n,
                                          part_m.key, part_m.first_index);
    narrow_pair_bf16_stochastic_scalar(m, v, part_m.exp_avg_out != nullptr ? part_m.exp_avg_out : part_m.exp_avg,
                                       part_m.exp_avg_sq_out != nullptr ? part_m.exp_avg_sq_out : part_m.exp_avg_sq,
                                       n, part_m.key, part_m.first_index);
  }
}

}  // namespace detail

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
    const int64_t begin = b0 * kBf16MomentsBlockNumel, end = std::min(b1 * kBf16MomentsBlockNumel, buffers.numel);
    switch (isa) {
      case SimdIsa::kAvx512: detail::adam_bf16_moments_avx512(c, buffers, moments, begin, end); return;
      case SimdIsa::kAvx2: detail::adam_bf16_moments_avx2(c, buffers, moments, begin, end); return;
      default: detail::adam_bf16_moments_scalar(c, buffers, moments, begin, end); return;
    }
  });
}

void cpu_adam_step_bf16_moments(const AdamHyper& hyper, const AdamBuffers& buffers, const Bf16Moments& moments) {
  cpu_adam_step_bf16_moments(hyper, buffers, moments, best_simd_isa());
}

}  // namespace gx
