#include "cpu_adam.h"

#include <cstdint>

#include <cmath>

#include "core/errors.h"
#include "half_convert.h"
#include "core/thread_pool.h"

namespace gx {

AdamConstants adam_constants(const AdamHyper& h) {
  const double bias1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bias2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  AdamConstants c{};
  c.lr = static_cast<float>(h.lr);
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.eps = static_cast<float>(h.eps);
  c.weight_decay = h.decoupled_weight_decay ? 0.0f : static_cast<float>(h.weight_decay);
  c.decay = h.decoupled_weight_decay ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  c.step_size = static_cast<float>(h.lr / bias1);
  c.bias2_sqrt = static_cast<float>(std::sqrt(bias2));
  c.grad_scale = static_cast<float>(h.grad_scale);
  return c;
}

void check_adam_hyper(const AdamHyper& h) {
  GX_CHECK(h.step >= 1, "Adam step: expected >= 1 (the count after this update), got ", h.step, ".");
  GX_CHECK(h.lr >= 0.0, "Adam lr: expected >= 0, got ", h.lr, ".");
  GX_CHECK(h.beta1 >= 0.0 && h.beta1 < 1.0, "Adam beta1: expected in [0, 1), got ", h.beta1, ".");
  GX_CHECK(h.beta2 >= 0.0 && h.beta2 < 1.0, "Adam beta2: expected in [0, 1), got ", h.beta2, ".");
  GX_CHECK(h.eps >= 0.0, "Adam eps: expected >= 0, got ", h.eps, ".");
  GX_CHECK(h.weight_decay >= 0.0, "Adam weight_decay: expected >= 0, got ", h.weight_decay, ".");
}

void check_adam_args(const AdamHyper& h, const AdamBuffers& b) {
  check_adam_hyper(h);
  GX_CHECK(b.numel >= 0, "Adam numel: expected >= 0, got ", b.numel, ".");
  if (b.numel == 0) return;
  GX_CHECK(b.param && b.exp_avg && b.exp_avg_sq && b.grad, "Adam buffers: param, exp_avg, exp_avg_sq and grad must "
           "all be set.");
  GX_CHECK(b.grad_dtype == DType::kFloat32 || b.grad_dtype == DType::kBFloat16 || b.grad_dtype == DType::kFloat16,
           "Adam grad dtype: expected float32, bfloat16 or float16, got ", to_string(b.grad_dtype), ".");
  GX_CHECK(
      (b.param_out == nullptr) == (b.exp_avg_out == nullptr) &&
          (b.param_out == nullptr) == (b.exp_avg_sq_out == nullptr),
      "Adam buffers: param_out, exp_avg_out and exp_avg_sq_out must be set together (out of place) or not at all.");
  GX_CHECK(b.param16 == nullptr || b.param16_dtype == DType::kBFloat16 || b.param16_dtype == DType::kFloat16,
           "Adam param16 dtype: expected bfloat16 or float16, got ", to_string(b.param16_dtype), ".");
}

namespace detail {

int64_t first_streamable(const AdamBuffers& b, int64_t begin, int64_t end, size_t alignment, int64_t width) {
  if (b.param_out == nullptr) return -1;
  auto aligned = [&](int64_t k) {
    return reinterpret_cast<uintptr_t>(b.param_out + k) % alignment == 0 &&
           reinterpret_cast<uintptr_t>(b.exp_avg_out + k) % alignment == 0 &&
           reinterpret_cast<uintptr_t>(b.exp_avg_sq_out + k) % alignment == 0;
  };
  for (int64_t k = begin; k < end && k - begin < width; ++k)
    if (aligned(k)) return k;
  return -1;
}

void cpu_adam_scalar(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end) {
  float* p = b.param;
  float* m = b.exp_avg;
  float* v = b.exp_avg_sq;
  float* po = b.out_param();
  float* mo = b.out_exp_avg();
  float* vo = b.out_exp_avg_sq();
  for (int64_t i = begin; i < end; ++i) {
    float g;
    switch (b.grad_dtype) {
      case DType::kBFloat16: g = bf16_to_float(static_cast<const uint16_t*>(b.grad)[i]); break;
      case DType::kFloat16: g = fp16_to_float(static_cast<const uint16_t*>(b.grad)[i]); break;
      default: g = static_cast<const float*>(b.grad)[i]; break;
    }
    // adam_update.h's arithmetic, which the SIMD paths repeat operation for operation.
    float pi = p[i], mi = m[i], vi = v[i];
    adam_update_element(c, g, pi, mi, vi);
    po[i] = pi;
    mo[i] = mi;
    vo[i] = vi;
    if (b.param16 != nullptr) {
      auto* out = static_cast<uint16_t*>(b.param16);
      out[i] = b.param16_dtype == DType::kBFloat16 ? float_to_bf16(pi) : float_to_fp16(pi);
    }
  }
}

}  // namespace detail

void cpu_adam_range(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end, SimdIsa isa) {
  switch (isa) {
    case SimdIsa::kAvx512: detail::cpu_adam_avx512(c, b, begin, end); return;
    case SimdIsa::kAvx2: detail::cpu_adam_avx2(c, b, begin, end); return;
    case SimdIsa::kScalar: detail::cpu_adam_scalar(c, b, begin, end); return;
  }
  GX_INTERNAL_ASSERT(false, "unknown SimdIsa");
}

void cpu_adam_step(const AdamHyper& hyper, const AdamBuffers& buffers, SimdIsa isa) {
  check_adam_args(hyper, buffers);
  GX_CHECK(static_cast<int>(isa) <= static_cast<int>(detected_simd_isa()), "cpu_adam_step: ISA ", to_string(isa),
           " requested but this CPU supports at most ", to_string(detected_simd_isa()), ".");
  const AdamConstants c = adam_constants(hyper);
  constexpr int64_t kGrainNumel = 1 << 16;  // 64 Ki elements (~1.8 MB of traffic) per thread at least
  constexpr int64_t kAlignNumel = 64;       // ranges start on cache-line multiples of every buffer
  const int64_t blocks = (buffers.numel + kAlignNumel - 1) / kAlignNumel;
  ThreadPool::global().parallel_for(blocks, kGrainNumel / kAlignNumel, [&](int64_t b0, int64_t b1) {
    cpu_adam_range(c, buffers, b0 * kAlignNumel, std::min(buffers.numel, b1 * kAlignNumel), isa);
  });
}

void cpu_adam_step(const AdamHyper& hyper, const AdamBuffers& buffers) {
  cpu_adam_step(hyper, buffers, best_simd_isa());
}

}  // namespace gx
