#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "core/half_convert.h"
#include "core/stochastic_round.h"

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

TEST(StochasticRound, HashedDrawsAreUnbiasedDeterministicAndDifferPerStream) {
  const float x = 1.0f + 0.3f * std::ldexp(1.0f, -7);  // 0.3 of a bf16 step above 1
  const uint32_t key = stochastic_stream_key(42, 0), other = stochastic_stream_key(42, 1);
  double sum = 0.0;
  int same = 0;
  const uint32_t n = 1U << 18;
  for (uint32_t i = 0; i < n; ++i) {
    sum += bf16_to_float(float_to_bf16_stochastic(x, stochastic_bits(key, i)));
    ASSERT_EQ(stochastic_bits(key, i), stochastic_bits(stochastic_stream_key(42, 0), i));
    same += (stochastic_bits(key, i) & 0xffffU) == (stochastic_bits(other, i) & 0xffffU);
  }
  const double step = std::ldexp(1.0, -7);
  EXPECT_NEAR(sum / n, x, 0.005 * step) << "the expected rounded value is the value";
  EXPECT_LT(same, 64) << "two streams draw independently";
  EXPECT_NE(stochastic_stream_key(42, 0), stochastic_stream_key(43, 0));
}

}  // namespace
}  // namespace gx
