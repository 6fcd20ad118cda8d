#include "cpu_optim.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/errors.h"
#include "half_convert.h"
#include "simd_scalar.h"
#include "core/thread_pool.h"

namespace gx {

namespace {

}  // namespace

namespace detail {
namespace optim_scalar {
#include "cpu_optim_kernels.inc"
}  // namespace optim_scalar

void cpu_optim_scalar(CpuOptimizer kind, const CpuOptimConstants& c, const CpuOptimBuffers& b, int64_t begin,
                      int64_t end) {
  optim_scalar::optim_body<simd_scalar::Vec>(kind, c, b, begin, end);
}
}  // namespace detail

const char* to_string(CpuOptimizer kind) {
  switch (kind) {
    case CpuOptimizer::kSgd: return "sgd";
    case CpuOptimizer::kLion: return "lion";
    case CpuOptimizer::kAdagrad: return "adagrad";
  }
  return "?";
}

int num_states(CpuOptimizer kind, bool sgd_momentum) {
  return kind == CpuOptimizer::kSgd && !sgd_momentum ? 0 : 1;
}

CpuOptimConstants cpu_optim_constants(const CpuOptimHyper& h) {
  CpuOptimConstants c{};
  c.lr = static_cast<float>(h.lr);
  c.neg_lr = static_cast<float>(-h.lr);
  c.weight_decay = static_cast<float>(h.weight_decay);
  c.has_weight_decay = h.weight_decay != 0.0;
  c.grad_scale = static_cast<float>(h.maximize ? -h.grad_scale : h.grad_scale);
  c.first_step = h.step == 1;
  c.has_momentum = h.momentum != 0.0;
  c.momentum = static_cast<float>(h.momentum);
  c.one_minus_dampening = static_cast<float>(1.0 - h.dampening);
  c.nesterov = h.nesterov;
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  c.eps = static_cast<float>(h.eps);
  c.initial_sum = static_cast<float>(h.initial_accumulator_value);
  if (h.kind == CpuOptimizer::kAdagrad)
    c.neg_lr = static_cast<float>(-(h.lr / (1.0 + static_cast<double>(h.step - 1) * h.lr_decay)));
  return c;
}

void check_cpu_optim_args(const CpuOptimHyper& h, const CpuOptimBuffers& b) {
  const char* name = to_string(h.kind);
  GX_CHECK(h.step >= 1, name, " step: expected >= 1 (the count after this update), got ", h.step, ".");
  GX_CHECK(h.lr >= 0.0, name, " lr: expected >= 0, got ", h.lr, ".");
  GX_CHECK(h.weight_decay >= 0.0, name, " weight_decay: expected >= 0, got ", h.weight_decay, ".");
  switch (h.kind) {
    case CpuOptimizer::kSgd:
      GX_CHECK(h.momentum >= 0.0, "sgd momentum: expected >= 0, got ", h.momentum, ".");
      GX_CHECK(!h.nesterov || (h.momentum > 0.0 && h.dampening == 0.0),
               "sgd nesterov: needs momentum > 0 and dampening 0, got momentum ", h.momentum, " and dampening ",
               h.dampening, ".");
      break;
    case CpuOptimizer::kLion:
      GX_CHECK(h.beta1 >= 0.0 && h.beta1 <= 1.0, "lion beta1: expected in [0, 1], got ", h.beta1, ".");
      GX_CHECK(h.beta2 >= 0.0 && h.beta2 <= 1.0, "lion beta2: expected in [0, 1], got ", h.beta2, ".");
      GX_CHECK(!h.maximize, "lion: maximize is not a Lion option.");
      break;
    case CpuOptimizer::kAdagrad:
      GX_CHECK(h.lr_decay >= 0.0, "adagrad lr_decay: expected >= 0, got ", h.lr_decay, ".");
      GX_CHECK(h.eps >= 0.0, "adagrad eps: expected >= 0, got ", h.eps, ".");
      GX_CHECK(h.initial_accumulator_value >= 0.0, "adagrad initial_accumulator_value: expected >= 0, got ",
               h.initial_accumulator_value, ".");
      break;
  }
  GX_CHECK(b.numel >= 0, name, " numel: expected >= 0, got ", b.numel, ".");
  if (b.numel == 0) return;
  GX_CHECK(b.param != nullptr && b.grad != nullptr, name, " buffers: param and grad must be set.");
  const int states = num_states(h.kind, h.momentum != 0.0);
  for (int k = 0; k < states; ++k)
    GX_CHECK(b.state[k] != nullptr, name, " buffers: state ", k, " must be set (", states, " state buffer(s)).");
  GX_CHECK(b.grad_dtype == DType::kFloat32 || b.grad_dtype == DType::kBFloat16 || b.grad_dtype == DType::kFloat16,
           name, " grad dtype: expected float32, bfloat16 or float16, got ", to_string(b.grad_dtype), ".");
  for (int k = 0; k < states; ++k)
    GX_CHECK((b.param_out == nullptr) == (b.state_out[k] == nullptr), name,
             " buffers: param_out and every state_out must be set together (out of place) or not at all.");
  GX_CHECK(b.param16 == nullptr || b.param16_dtype == DType::kBFloat16 || b.param16_dtype == DType::kFloat16, name,
           " param16 dtype: expected bfloat16 or float16, got ", to_string(b.param16_dtype), ".");
}

void cpu_optim_range(CpuOptimizer kind, const CpuOptimConstants& c, const CpuOptimBuffers& b, int64_t begin,
                     int64_t end, SimdIsa isa) {
  switch (isa) {
    case SimdIsa::kAvx512: detail::cpu_optim_avx512(kind, c, b, begin, end); return;
    case SimdIsa::kAvx2: detail::cpu_optim_avx2(kind, c, b, begin, end); return;
    case SimdIsa::kScalar: detail::cpu_optim_scalar(kind, c, b, begin, end); return;
  }
  GX_INTERNAL_ASSERT(false, "unknown SimdIsa");
}

void cpu_optim_step(const CpuOptimHyper& hyper, const CpuOptimBuffers& buffers, SimdIsa isa) {
  check_cpu_optim_args(hyper, buffers);
  GX_CHECK(static_cast<int>(isa) <= static_cast<int>(detected_simd_isa()), to_string(hyper.kind), " step: ISA ",
           to_string(isa), " requested but this CPU supports at most ", to_string(detected_simd_isa()), ".");
  const CpuOptimConstants c = cpu_optim_constants(hyper);
  constexpr int64_t kGrainNumel = 1 << 16;  // 64 Ki elements per thread at least
  constexpr int64_t kAlignNumel = 64;       // ranges start on cache-line multiples of every buffer
  const int64_t blocks = (buffers.numel + kAlignNumel - 1) / kAlignNumel;
  ThreadPool::global().parallel_for(blocks, kGrainNumel / kAlignNumel, [&](int64_t b0, int64_t b1) {
    cpu_optim_range(hyper.kind, c, buffers, b0 * kAlignNumel, std::min(buffers.numel, b1 * kAlignNumel), isa);
  });
}

void cpu_optim_step(const CpuOptimHyper& hyper, const CpuOptimBuffers& buffers) {
  cpu_optim_step(hyper, buffers, best_simd_isa());
}

}  // namespace gx
