// The Adam / AdamW update of one element: the arithmetic every implementation computes.
//
// Design note. The CPU scalar loop (cpu_adam.cpp) and the CUDA kernel (csrc/cuda/adam_kernel.cu)
// call this function; the AVX2 and AVX-512 loops do the same operations in the same order with
// fused multiply-adds in the same places. Every operation is a correctly rounded IEEE float
// operation: on the host the compiler's (no fast-math), on the device the explicit
// round-to-nearest intrinsics, which the compiler never contracts into other fused
// multiply-adds. So a chunk stepped on the device equals the same chunk stepped by the CPU
// kernel bit for bit, and a set may move between the tiers without changing the numerics.
#pragma once

#include <cmath>

#include "half_convert.h"

namespace gx {

// The per-step float constants every path uses (adam_constants() in cpu_adam.h derives them).
struct AdamConstants {
  float lr;
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float weight_decay;   // Adam: L2 coefficient; AdamW: 0 (folded into decay)
  float decay;          // AdamW: 1 - lr * wd; Adam: 1
  float step_size;      // lr / (1 - beta1^t)
  float bias2_sqrt;     // sqrt(1 - beta2^t)
  float grad_scale;
};

namespace rn {  // correctly rounded float operations that the compiler may not fuse
#if defined(__CUDA_ARCH__)
__device__ inline float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ inline float add(float a, float b) { return __fadd_rn(a, b); }
__device__ inline float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ inline float div(float a, float b) { return __fdiv_rn(a, b); }
__device__ inline float sqrt(float a) { return __fsqrt_rn(a); }
__device__ inline float fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
#else
inline float mul(float a, float b) { return a * b; }
inline float add(float a, float b) { return a + b; }
inline float sub(float a, float b) { return a - b; }
inline float div(float a, float b) { return a / b; }
inline float sqrt(float a) { return std::sqrt(a); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
#endif
}  // namespace rn

// One element: `grad` as read (widened to float), the master `param` and the moments `exp_avg`
// (m) and `exp_avg_sq` (v) updated in place.
GX_HOST_DEVICE inline void adam_update_element(const AdamConstants& c, float grad, float& param, float& exp_avg,
                                               float& exp_avg_sq) {
  const float g0 = rn::mul(grad, c.grad_scale);
  float p = param;
  const float g = rn::fma(c.weight_decay, p, g0);
  p = rn::mul(p, c.decay);
  const float m = rn::fma(c.one_minus_beta1, rn::sub(g, exp_avg), exp_avg);
  const float v = rn::fma(c.one_minus_beta2, rn::mul(g, g), rn::mul(c.beta2, exp_avg_sq));
  const float denom = rn::add(rn::div(rn::sqrt(v), c.bias2_sqrt), c.eps);
  param = rn::fma(-c.step_size, rn::div(m, denom), p);
  exp_avg = m;
  exp_avg_sq = v;
}

}  // namespace gx
