// CPU Adam / AdamW: one fused pass over a chunk's fp32 master, m, v and its gradient.
//
// Design note. Per element i, with t the step count after increment (the torch.optim update,
// amsgrad off, maximize off):
//   g  = grad[i] * grad_scale                       (grad may be fp32, bf16 or fp16; grad_scale
//                                                     folds 1/loss_scale and the clip coefficient)
//   Adam:  g += weight_decay * p       AdamW:  p *= 1 - lr * weight_decay
//   m  = m + (1 - beta1) * (g - m)                  (torch's lerp for weight < 0.5)
//   v  = beta2 * v + (1 - beta2) * g * g
//   p -= (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   param16[i] = round_to_nearest_even(p)           (optional bf16 / fp16 copy for compute)
// Scalars are computed in double and used as float, as torch does. Memory traffic is one read of
// p, m, v, grad and one write of p, m, v, param16: 28 bytes per parameter with bf16 in and out,
// where torch's fused CPU AdamW needs a separate cast of the gradient and of the parameter.
// Three implementations with one result contract: scalar, AVX2+F16C+FMA and AVX-512 (F, BW),
// picked by best_simd_isa() (GEMINI_EXT_SIMD caps it). All three do adam_update.h's float
// operations in the same order, with fused multiply-adds in the same places, and
// the same round-to-nearest-even conversions as half_convert.h, so their results are
// bit-identical. Against torch.optim (which rounds some of these steps differently) they agree
// within 1e-6 relative on parameters.
// cpu_adam_step splits the elements over the ThreadPool in contiguous ranges.
#pragma once

#include <cstdint>

#include "adam_update.h"
#include "cpu_features.h"
#include "core/types.h"

namespace gx {

struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled_weight_decay = true;  // AdamW; false: Adam (L2 added to the gradient)
  int64_t step = 1;                    // t, already incremented for this update (>= 1)
  double grad_scale = 1.0;
};

struct AdamBuffers {
  float* param = nullptr;       // fp32 master
  float* exp_avg = nullptr;     // m
  float* exp_avg_sq = nullptr;  // v
  const void* grad = nullptr;
  DType grad_dtype = DType::kFloat32;  // float32, bfloat16 or float16
  void* param16 = nullptr;             // optional 16-bit copy of the updated param
  DType param16_dtype = DType::kBFloat16;
  int64_t numel = 0;
  // Out of place (all three or none): the update reads param, exp_avg, exp_avg_sq and writes
  // these instead, leaving the inputs as they were (a speculative step that may be discarded).
  float* param_out = nullptr;
  float* exp_avg_out = nullptr;
  float* exp_avg_sq_out = nullptr;
  float* out_param() const { return param_out != nullptr ? param_out : param; }
  float* out_exp_avg() const { return exp_avg_out != nullptr ? exp_avg_out : exp_avg; }
  float* out_exp_avg_sq() const { return exp_avg_sq_out != nullptr ? exp_avg_sq_out : exp_avg_sq; }
};

// The per-step float constants of `hyper` (adam_update.h).
AdamConstants adam_constants(const AdamHyper& hyper);

// Validates the hyperparameters (UsageError naming the bad one).
void check_adam_hyper(const AdamHyper& hyper);
// Validates buffers and hyperparameters (UsageError naming the bad one).
void check_adam_args(const AdamHyper& hyper, const AdamBuffers& buffers);

// One update of elements [begin, end) with a given implementation (no threading).
void cpu_adam_range(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end, SimdIsa isa);
// One update of all elements over the global ThreadPool with best_simd_isa() (or `isa`).
void cpu_adam_step(const AdamHyper& hyper, const AdamBuffers& buffers);
void cpu_adam_step(const AdamHyper& hyper, const AdamBuffers& buffers, SimdIsa isa);

namespace detail {
// Out of place: the first element of [begin, end), within one vector of `width` elements, from
// which all three fp32 outputs are `alignment`-byte aligned (the SIMD paths stream from there);
// -1 in place or when the outputs never align together.
int64_t first_streamable(const AdamBuffers& b, int64_t begin, int64_t end, size_t alignment, int64_t width);
void cpu_adam_scalar(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end);
void cpu_adam_avx2(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end);
void cpu_adam_avx512(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end);
}  // namespace detail

}  // namespace gx
