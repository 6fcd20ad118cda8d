// The scalar vector type of the CPU optimizer kernels: one float per "vector", std::fma where the
// SIMD paths fuse (their instructions round the same way), so a kernel template instantiated with
// it (cpu_optim_kernels.inc, adam_correction_kernels.inc) computes the SIMD paths' bits; it also
// finishes their tails.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/types.h"
#include "half_convert.h"

namespace gx::simd_scalar {

struct Vec {
  using F = float;
  static constexpr int64_t kWidth = 1;
  static F set1(float x) { return x; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static F grad(const void* g, DType dtype, int64_t i) {
    switch (dtype) {
      case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(g)[i]);
      case DType::kFloat16: return fp16_to_float(static_cast<const uint16_t*>(g)[i]);
      default: return static_cast<const float*>(g)[i];
    }
  }
  static void store16(void* out, DType dtype, int64_t i, F x) {
    static_cast<uint16_t*>(out)[i] = dtype == DType::kBFloat16 ? float_to_bf16(x) : float_to_fp16(x);
  }
  static F mul(F a, F b) { return a * b; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  static F fma(F a, F b, F c) { return std::fma(a, b, c); }
  static F max(F a, F b) { return a > b ? a : b; }  // as maxps: the second operand unless a > b
  static F sign(F x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x); }
  // Lane masks (one bool), for kernels that pick per element.
  using M = bool;
  static M eq(F a, F b) { return a == b; }
  static M both(M a, M b) { return a && b; }
  static M all_lanes() { return true; }
  static F select(M m, F if_true, F if_false) { return m ? if_true : if_false; }
};

}  // namespace gx::simd_scalar
