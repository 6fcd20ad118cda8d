// Stochastic rounding of fp32 to bf16, with counter-based random bits.
//
// Design note. Rounding to nearest loses an update smaller than half a bf16 step every time:
// an optimizer moment kept in bf16 that way stalls once its increments fall below 2^-9 of its
// value. Stochastic rounding rounds up with probability equal to the dropped fraction, so the
// expected stored value is the fp32 value and small increments survive on average. The random
// bits are a pure function of (key, element index): a step is reproducible (a resumed run
// rounds as the original did) and every implementation (the CPU loops, the CUDA kernel) that
// evaluates the same function rounds identically. The hash is the "lowbias32" integer finaliser
// (two multiply-xorshift rounds), a bijection on 32 bits; one hash per element serves two
// tensors: the low 16 bits are the first one's draw (Adam's m), the high 16 bits the second's
// (v), so the pair costs one hash; a bf16 parameter stepped without an fp32 master draws from a
// second stream (param_stream_key). The inline functions compile as CUDA device code too
// (csrc/cuda/adam_kernel.cu); the loops have scalar, AVX2 and AVX-512 versions
// (stochastic_round_avx2.cpp, stochastic_round_avx512.cpp), bit-identical.
#pragma once

#include <cstdint>

#include "cpu_features.h"
#include "half_convert.h"

namespace gx {

GX_HOST_DEVICE inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// The key of one optimizer step of one chunk: the same on every rank and in every path.
GX_HOST_DEVICE inline uint32_t stochastic_key(int64_t step, int64_t chunk) {
  return mix32(static_cast<uint32_t>(step) ^ mix32(static_cast<uint32_t>(chunk) + 0x9e3779b9U));
}

// 32 random bits for element `index` (< 2^32 in one stream) under `key`.
GX_HOST_DEVICE inline uint32_t stochastic_bits(uint32_t key, uint32_t index) { return mix32(index ^ key); }

// The key of a bf16 parameter's own stream under a step's and chunk's `key`: the parameter draws
// the low 16 bits of stochastic_bits(param_stream_key(key), index), independent of the moments'.
GX_HOST_DEVICE inline uint32_t param_stream_key(uint32_t key) { return mix32(key ^ 0x632be5abU); }

// fp32 -> bf16 rounding the magnitude up with probability (dropped low 16 bits) / 2^16, taking
// the low 16 bits of `random` as the uniform draw. Exact values stay exact; inf and NaN round to
// nearest (NaN stays NaN).
GX_HOST_DEVICE inline uint16_t float_to_bf16_stochastic(float f, uint32_t random) {
  uint32_t bits = float_to_bits(f);
  if ((bits & 0x7f800000U) == 0x7f800000U) return float_to_bf16(f);
  bits += random & 0xffffU;
  return static_cast<uint16_t>(bits >> 16);
}

// Which half of an element's 32 random bits a tensor draws from.
enum class DrawHalf : int { kLow = 0, kHigh = 16 };

// out[i] = float_to_bf16_stochastic(x[i], stochastic_bits(key, first_index + i) >> half) over the
// global ThreadPool (host memory).
void narrow_to_bf16_stochastic(const float* x, uint16_t* out, int64_t n, uint32_t key, uint32_t first_index,
                               DrawHalf half);

// One thread's loops, with a given implementation (scalar, AVX2, AVX-512: bit-identical):
// widening, and rounding a pair of tensors (a from the low half of each element's bits, b from
// the high half) with one hash per element.
void widen_bf16(const uint16_t* in, float* out, int64_t n, SimdIsa isa);
void narrow_pair_bf16_stochastic(const float* a, const float* b, uint16_t* a_out, uint16_t* b_out, int64_t n,
                                 uint32_t key, uint32_t first_index, SimdIsa isa);

namespace detail {
void widen_bf16_scalar(const uint16_t* in, float* out, int64_t n);
void widen_bf16_avx2(const uint16_t* in, float* out, int64_t n);
void widen_bf16_avx512(const uint16_t* in, float* out, int64_t n);
// A bf16 parameter's rounding: out[i] from the low half of
// stochastic_bits(param_stream_key(key), first_index + i).
void narrow_param_bf16_stochastic_scalar(const float* x, uint16_t* out, int64_t n, uint32_t key, uint32_t first_index);
void narrow_pair_bf16_stochastic_scalar(const float* a, const float* b, uint16_t* a_out, uint16_t* b_out, int64_t n,
                                        uint32_t key, uint32_t first_index);
void narrow_pair_bf16_stochastic_avx2(const float* a, const float* b, uint16_t* a_out, uint16_t* b_out, int64_t n,
                                      uint32_t key, uint32_t first_index);
void narrow_pair_bf16_stochastic_avx512(const float* a, const float* b, uint16_t* a_out, uint16_t* b_out, int64_t n,
                                        uint32_t key, uint32_t first_index);
}  // namespace detail

}  // namespace gx
