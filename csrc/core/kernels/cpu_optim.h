// CPU SGD, Lion and Adagrad: one fused pass per chunk run, like CPU Adam (cpu_adam.h).
//
// Design note. Each kernel reads the fp32 master, its fp32 state and a fp32/bf16/fp16 gradient
// and writes master, state and (optionally) the 16-bit parameter copy in one pass. Per element,
// with g = grad * grad_scale (grad_scale folds 1/loss_scale, the clip coefficient and, for
// `maximize`, the sign) and fma(a, b, c) = a * b + c rounded once:
//   SGD (torch.optim.SGD):   g = fma(wd, p, g) if wd != 0
//                            momentum != 0: buf = first step ? g : fma(1 - dampening, g, momentum * buf)
//                                           g = nesterov ? fma(momentum, buf, g) : buf
//                            p = fma(-lr, g, p)
//   Lion (Chen et al. 2023): u = sign(fma(1 - beta1, g, beta1 * m))
//                            p = fma(-lr, u, p * (1 - lr * wd))
//                            m = fma(1 - beta2, g, beta2 * m)
//   Adagrad (torch.optim.Adagrad): g = fma(wd, p, g) if wd != 0
//                            s = fma(g, g, first step ? initial_accumulator_value : s)
//                            p = fma(-clr, g / (sqrt(s) + eps), p),  clr = lr / (1 + (t - 1) * lr_decay)
// These are the roundings of torch's own CPU kernels (its add with alpha is a fused multiply-add),
// so the results agree with torch.optim to within an ulp or two. Scalars are computed in double
// and used as float. Each kernel is written once (cpu_optim_kernels.inc) against a vector type
// and compiled three times: scalar, AVX2+FMA+F16C and AVX-512; the three do the same float
// operations in the same order, so their results are bit-identical (the GoogleTest checks it).
// cpu_optim_step splits the elements over the ThreadPool in contiguous ranges.
#pragma once

#include <cstdint>

#include "cpu_features.h"
#include "core/types.h"

namespace gx {

enum class CpuOptimizer : int { kSgd, kLion, kAdagrad };
const char* to_string(CpuOptimizer kind);
int num_states(CpuOptimizer kind, bool sgd_momentum);  // fp32 state buffers the kernel reads and writes

struct CpuOptimHyper {
  CpuOptimizer kind = CpuOptimizer::kSgd;
  double lr = 1e-3;
  double weight_decay = 0.0;
  double grad_scale = 1.0;
  int64_t step = 1;  // t, already incremented for this update (>= 1)
  bool maximize = false;  // SGD, Adagrad
  // SGD
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  // Lion
  double beta1 = 0.9;
  double beta2 = 0.99;
  // Adagrad
  double lr_decay = 0.0;
  double eps = 1e-10;
  double initial_accumulator_value = 0.0;
};

constexpr int kMaxCpuOptimStates = 1;

struct CpuOptimBuffers {
  float* param = nullptr;  // fp32 master
  float* state[kMaxCpuOptimStates] = {nullptr};  // SGD: momentum_buffer (momentum != 0); Lion: exp_avg; Adagrad: sum
  const void* grad = nullptr;
  DType grad_dtype = DType::kFloat32;
  void* param16 = nullptr;  // optional 16-bit copy of the updated param
  DType param16_dtype = DType::kBFloat16;
  int64_t numel = 0;
  // Out of place (param_out and every state_out, or none): the inputs stay as they were.
  float* param_out = nullptr;
  float* state_out[kMaxCpuOptimStates] = {nullptr};
  float* out_param() const { return param_out != nullptr ? param_out : param; }
  float* out_state(int k) const { return state_out[k] != nullptr ? state_out[k] : state[k]; }
};

// The per-step float constants every path uses.
struct CpuOptimConstants {
  float lr;
  float neg_lr;           // -lr (SGD, Lion) or -clr (Adagrad)
  float weight_decay;
  bool has_weight_decay;  // SGD, Adagrad: wd != 0 (torch skips the term otherwise)
  float grad_scale;       // negative for maximize
  bool first_step;
  // SGD
  bool has_momentum;
  float momentum;
  float one_minus_dampening;
  bool nesterov;
  // Lion
  float beta1, one_minus_beta1, beta2, one_minus_beta2, decay;
  // Adagrad
  float eps;
  float initial_sum;
};
CpuOptimConstants cpu_optim_constants(const CpuOptimHyper& hyper);

// Validates buffers and hyperparameters (UsageError naming the bad one).
void check_cpu_optim_args(const CpuOptimHyper& hyper, const CpuOptimBuffers& buffers);

// One update of elements [begin, end) with a given implementation (no threading).
void cpu_optim_range(CpuOptimizer kind, const CpuOptimConstants& c, const CpuOptimBuffers& b, int64_t begin,
                     int64_t end, SimdIsa isa);
// One update of all elements over the global ThreadPool with best_simd_isa() (or `isa`).
void cpu_optim_step(const CpuOptimHyper& hyper, const CpuOptimBuffers& buffers);
void cpu_optim_step(const CpuOptimHyper& hyper, const CpuOptimBuffers& buffers, SimdIsa isa);

namespace detail {
void cpu_optim_scalar(CpuOptimizer kind, const CpuOptimConstants& c, const CpuOptimBuffers& b, int64_t begin,
                      int64_t end);
void cpu_optim_avx2(CpuOptimizer kind, const CpuOptimConstants& c, const CpuOptimBuffers& b, int64_t begin,
                    int64_t end);
void cpu_optim_avx512(CpuOptimizer kind, const CpuOptimConstants& c, const CpuOptimBuffers& b, int64_t begin,
                      int64_t end);
}  // namespace detail

}  // namespace gx
