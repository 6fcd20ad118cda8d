#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "core/kernels/half_convert.h"
#include "core/kernels/stochastic_round.h"
#include "simd_isas.h"

namespace gx {
namespace {

TEST(StochasticRound, RepresentableValuesStayExactWhateverTheDraw) {
  std::mt19937 rng(1);
  for (int k = 0; k < 10000; ++k) {
    const uint16_t h = static_cast<uint16_t>(rng() & 0x7f7fU);  // finite, either sign below
    const float x = bf16_to_float(h);
    for (const uint32_t r : {0U, 1U, 0x8000U, 0xffffU, static_cast<uint32_t>(rng())})
      ASSERT_EQ(float_to_bf16_stochastic(x, r), h) << x;
    ASSERT_EQ(float_to_bf16_stochastic(-x, 0xffffU), static_cast<uint16_t>(h | 0x8000U));
  }
}

TEST(StochasticRound, RoundsTheMagnitudeUpForExactlyTheDroppedFractionOfDraws) {
  for (const float base : {1.0f, -3.5f, 1e-20f, 6.5e4f}) {
    const uint32_t bits = float_to_bits(base) & 0xffff0000U;  // a bf16 value
    for (const uint32_t low : {1U, 0x4000U, 0x8000U, 0xbeefU}) {
      const float x = bits_to_float(bits | low);
      int up = 0;
      for (uint32_t r = 0; r < 0x10000U; ++r) {
        const uint16_t h = float_to_bf16_stochastic(x, r);
        ASSERT_TRUE(h == (bits >> 16) || h == (bits >> 16) + 1U) << x;
        up += h != (bits >> 16);
      }
      EXPECT_EQ(up, static_cast<int>(low)) << "x " << x << ": P(up) must be the dropped fraction";
    }
  }
}

TEST(StochasticRound, InfinityAndNanRoundToNearest) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(float_to_bf16_stochastic(inf, 0xffffU), float_to_bf16(inf));
  EXPECT_EQ(float_to_bf16_stochastic(-inf, 0xffffU), float_to_bf16(-inf));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16_stochastic(std::nanf(""), 0xffffU))));
}

TEST(StochasticRound, HashedDrawsAreUnbiasedDeterministicAndTheTwoHalvesIndependent) {
  const float x = 1.0f + 0.3f * std::ldexp(1.0f, -7);  // 0.3 of a bf16 step above 1
  const uint32_t key = stochastic_key(3, 42);
  double low_sum = 0.0, high_sum = 0.0;
  int same = 0;
  const uint32_t n = 1U << 18;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t bits = stochastic_bits(key, i);
    ASSERT_EQ(bits, stochastic_bits(stochastic_key(3, 42), i));
    low_sum += bf16_to_float(float_to_bf16_stochastic(x, bits));
    high_sum += bf16_to_float(float_to_bf16_stochastic(x, bits >> 16));
    same += (bits & 0xffffU) == (bits >> 16);
  }
  const double step = std::ldexp(1.0, -7);
  EXPECT_NEAR(low_sum / n, x, 0.005 * step) << "the expected rounded value is the value";
  EXPECT_NEAR(high_sum / n, x, 0.005 * step);
  EXPECT_LT(same, 64) << "the two halves draw independently";
  EXPECT_NE(stochastic_key(3, 42), stochastic_key(4, 42));
  EXPECT_NE(stochastic_key(3, 42), stochastic_key(3, 43));
}

TEST(StochasticRound, EveryIsaWidensAndRoundsBitIdenticallyToTheScalarFunctions) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 10.0f);
  const int64_t n = 1000 + 13;  // a scalar tail after the vectors
  std::vector<float> a(n), b(n);
  for (int64_t i = 0; i < n; ++i) {
    a[i] = normal(rng);
    b[i] = normal(rng);
  }
  a[3] = b[4] = std::numeric_limits<float>::infinity();
  a[4] = b[3] = -std::numeric_limits<float>::infinity();
  a[5] = b[6] = std::nanf("");
  a[6] = b[5] = 3.3e38f;
  a[7] = b[7] = -1e-41f;
  const uint32_t key = stochastic_key(77, 1), first = 0xfffffff0U;  // the index wraps past 2^32
  std::vector<uint16_t> want_a(n), want_b(n);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = stochastic_bits(key, first + static_cast<uint32_t>(i));
    want_a[i] = float_to_bf16_stochastic(a[i], bits);
    want_b[i] = float_to_bf16_stochastic(b[i], bits >> 16);
  }
  for (SimdIsa isa : available_isas()) {
    std::vector<uint16_t> got_a(n), got_b(n);
    narrow_pair_bf16_stochastic(a.data(), b.data(), got_a.data(), got_b.data(), n, key, first, isa);
    EXPECT_EQ(got_a, want_a) << to_string(isa);
    EXPECT_EQ(got_b, want_b) << to_string(isa);
    std::vector<float> wide(n);
    widen_bf16(got_a.data(), wide.data(), n, isa);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(float_to_bits(wide[i]), float_to_bits(bf16_to_float(got_a[i]))) << i;
  }
  std::vector<uint16_t> pooled(n);  // the ThreadPool loop for one tensor, from either half
  narrow_to_bf16_stochastic(b.data(), pooled.data(), n, key, first, DrawHalf::kHigh);
  EXPECT_EQ(pooled, want_b);
}

}  // namespace
}  // namespace gx
