// Scalar conversions between float and the 16-bit formats (bf16, fp16), round to nearest even.
//
// Design note. These are the reference the SIMD paths must match bit for bit; they follow IEEE
// rounding as torch's own conversions do: bf16 keeps the top 16 bits after adding 0x7FFF plus
// the lowest kept bit (NaN stays a quiet NaN); fp16 rounds the 24-bit significand to 11 bits,
// handles subnormals, overflow to infinity and NaN.
// They also compile as CUDA device code (GX_HOST_DEVICE), so that a device kernel rounds exactly
// as the CPU kernels do.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define GX_HOST_DEVICE __host__ __device__
#else
#define GX_HOST_DEVICE
#endif

namespace gx {

GX_HOST_DEVICE inline float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}
GX_HOST_DEVICE inline uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

GX_HOST_DEVICE inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

GX_HOST_DEVICE inline uint16_t float_to_bf16(float f) {
  const uint32_t bits = float_to_bits(f);
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0)
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

GX_HOST_DEVICE inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return bits_to_float(sign | 0x7F800000u | (mantissa << 13));  // inf / NaN
  if (exponent == 0) {
    if (mantissa == 0) return bits_to_float(sign);
    // Subnormal: normalise.
    int shift = 0;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    mantissa &= 0x3FFu;
    exponent = static_cast<uint32_t>(1 - shift);
    return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }
  return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

GX_HOST_DEVICE inline uint16_t float_to_fp16(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits >= 0x7F800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7C00u | (abs_bits > 0x7F800000u ? 0x200u : 0u));
  }
  if (abs_bits >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to >= 65520: inf
  if (abs_bits < 0x38800000u) {                                                 // below 2^-14: subnormal or zero
    if (abs_bits < 0x33000000u) return static_cast<uint16_t>(sign);              // below 2^-25: zero
    const uint32_t exponent = abs_bits >> 23;
    const uint32_t mantissa = (abs_bits & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // 14..24 + 1
    const uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    const uint32_t rounded = half + ((rest > halfway || (rest == halfway && (half & 1u))) ? 1u : 0u);
    return static_cast<uint16_t>(sign | rounded);
  }
  const uint32_t rebased = abs_bits - 0x38000000u;  // exponent bias 127 -> 15
  const uint32_t rounding = 0xFFFu + ((rebased >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rebased + rounding) >> 13));
}

}  // namespace gx
