#include "adam_correction.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "core/errors.h"
#include "core/thread_pool.h"
#include "half_convert.h"
#include "simd_scalar.h"

namespace gx {

namespace {

constexpr int64_t kCorrectionGrainNumel = 1 << 16;  // per thread at least, as cpu_adam_step
constexpr int64_t kCorrectionAlignNumel = 64;       // ranges start on cache-line multiples of every buffer

void check_in_place(const AdamHyper& hyper, const AdamBuffers& b, const char* what) {
  check_adam_args(hyper, b);
  GX_CHECK(b.param_out == nullptr, what, ": works in place; the buffers name out-of-place outputs.");
}

template <class Range>
void over_pool(int64_t numel, const Range& range) {
  const int64_t blocks = (numel + kCorrectionAlignNumel - 1) / kCorrectionAlignNumel;
  ThreadPool::global().parallel_for(blocks, kCorrectionGrainNumel / kCorrectionAlignNumel, [&](int64_t b0, int64_t b1) {
    range(b0 * kCorrectionAlignNumel, std::min(numel, b1 * kCorrectionAlignNumel));
  });
}

template <class T>
bool range_finite(const T* x, int64_t begin, int64_t end, T exponent) {
  bool bad = false;
  for (int64_t i = begin; i < end; ++i) bad |= (x[i] & exponent) == exponent;  // vectorizes: integer ops only
  return !bad;
}

}  // namespace

namespace detail {
namespace correction_scalar {
#include "adam_correction_kernels.inc"
}  // namespace correction_scalar

AdamCorrectionConstants adam_correction_constants(const AdamHyper& hyper, double true_multiplier) {
  AdamCorrectionConstants k{};
  k.step = adam_constants(hyper);
  k.diff_scale = static_cast<float>(hyper.grad_scale - true_multiplier);
  k.sum_scale = static_cast<float>(hyper.grad_scale + true_multiplier);
  k.true_scale = static_cast<float>(true_multiplier);
  k.fresh = hyper.step == 1;
  k.l2 = !hyper.decoupled_weight_decay && hyper.weight_decay != 0.0;
  k.two_weight_decay = k.l2 ? static_cast<float>(2.0 * hyper.weight_decay) : 0.0f;
  k.undo_m = hyper.beta1 != 0.0;
  k.undo_v = hyper.beta2 != 0.0;
  return k;
}

void adam_correct_scalar(const AdamCorrectionConstants& k, const AdamBuffers& b, int64_t begin, int64_t end) {
  correction_scalar::adam_correct_body<simd_scalar::Vec>(k, b, begin, end);
}

void adam_undo_scalar(const AdamCorrectionConstants& k, const AdamBuffers& b, int64_t begin, int64_t end) {
  correction_scalar::adam_undo_body<simd_scalar::Vec>(k, b, begin, end);
}
}  // namespace detail

void adam_correct_step(const AdamHyper& hyper, double true_multiplier, const AdamBuffers& buffers, SimdIsa isa) {
  check_in_place(hyper, buffers, "adam_correct_step");
  GX_CHECK(std::isfinite(true_multiplier), "adam_correct_step: the true multiplier must be finite, got ",
           true_multiplier, ".");
  const AdamCorrectionConstants k = detail::adam_correction_constants(hyper, true_multiplier);
  over_pool(buffers.numel, [&](int64_t begin, int64_t end) {
    switch (isa) {
      case SimdIsa::kAvx512: detail::adam_correct_avx512(k, buffers, begin, end); return;
      case SimdIsa::kAvx2: detail::adam_correct_avx2(k, buffers, begin, end); return;
      case SimdIsa::kScalar: detail::adam_correct_scalar(k, buffers, begin, end); return;
    }
  });
}

void adam_correct_step(const AdamHyper& hyper, double true_multiplier, const AdamBuffers& buffers) {
  adam_correct_step(hyper, true_multiplier, buffers, best_simd_isa());
}

void adam_undo_step(const AdamHyper& hyper, const AdamBuffers& buffers, SimdIsa isa) {
  check_in_place(hyper, buffers, "adam_undo_step");
  const AdamCorrectionConstants k = detail::adam_correction_constants(hyper, hyper.grad_scale);
  over_pool(buffers.numel, [&](int64_t begin, int64_t end) {
    switch (isa) {
      case SimdIsa::kAvx512: detail::adam_undo_avx512(k, buffers, begin, end); return;
      case SimdIsa::kAvx2: detail::adam_undo_avx2(k, buffers, begin, end); return;
      case SimdIsa::kScalar: detail::adam_undo_scalar(k, buffers, begin, end); return;
    }
  });
}

void adam_undo_step(const AdamHyper& hyper, const AdamBuffers& buffers) {
  adam_undo_step(hyper, buffers, best_simd_isa());
}

bool all_finite(const void* data, DType dtype, int64_t numel) {
  GX_CHECK(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16,
           "all_finite: expected float32, bfloat16 or float16, got ", to_string(dtype), ".");
  std::atomic<bool> finite{true};
  over_pool(numel, [&](int64_t begin, int64_t end) {
    bool ok;
    switch (dtype) {
      case DType::kBFloat16: ok = range_finite(static_cast<const uint16_t*>(data), begin, end, uint16_t{0x7f80}); break;
      case DType::kFloat16: ok = range_finite(static_cast<const uint16_t*>(data), begin, end, uint16_t{0x7c00}); break;
      default: ok = range_finite(static_cast<const uint32_t*>(data), begin, end, uint32_t{0x7f800000u}); break;
    }
    if (!ok) finite.store(false, std::memory_order_relaxed);
  });
  return finite.load();
}

}  // namespace gx
