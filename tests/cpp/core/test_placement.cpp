#include <gtest/gtest.h>

#include "core/errors.h"
#include "core/lru_eviction.h"
#include "core/static_placement.h"

namespace gx {
namespace {

TEST(StaticPlacement, FractionsSelectExactBytesFromTheDocumentedEnds) {
  const std::vector<int64_t> bytes{100, 100, 100, 100};
  auto none = static_placement(bytes, {0.0, 0.0});
  for (const auto& p : none) EXPECT_FALSE(p.param_home_on_host || p.optim_on_host);
  auto all = static_placement(bytes, {1.0, 1.0});
  for (const auto& p : all) EXPECT_TRUE(p.param_home_on_host && p.optim_on_host);
  auto half = static_placement(bytes, {0.5, 0.5});
  // params from the front (used first in forward), optimizer state from the back
  EXPECT_EQ((std::vector<bool>{half[0].param_home_on_host, half[1].param_home_on_host, half[2].param_home_on_host,
                               half[3].param_home_on_host}),
            (std::vector<bool>{true, true, false, false}));
  EXPECT_EQ((std::vector<bool>{half[0].optim_on_host, half[1].optim_on_host, half[2].optim_on_host,
                               half[3].optim_on_host}),
            (std::vector<bool>{false, false, true, true}));
}

TEST(StaticPlacement, NeverExceedsTheFractionOfBytes) {
  const std::vector<int64_t> bytes{100, 100, 100};
  auto sel = select_by_bytes(bytes, 0.5, false);
  EXPECT_EQ(sel, (std::vector<bool>{true, false, false})) << "two chunks would be 66% > 50%";
  auto big_first = select_by_bytes({300, 10, 10}, 0.5, false);
  EXPECT_EQ(big_first, (std::vector<bool>{false, false, false})) << "walks in order, stops at the first misfit";
  EXPECT_THROW(select_by_bytes(bytes, 1.5, false), UsageError);
  EXPECT_EQ(select_by_bytes({}, 1.0, true).size(), 0u);
}

TEST(LruEviction, ChoosesTheLeastRecentlyUsedCandidateDeterministically) {
  LruEviction lru;
  EXPECT_FALSE(lru.choose({}).has_value());
  EXPECT_EQ(*lru.choose({3, 1, 2}), 1) << "never used: lowest id";
  lru.touch(1);
  lru.touch(3);
  lru.touch(2);
  EXPECT_EQ(*lru.choose({1, 2, 3}), 1);
  lru.touch(1);
  EXPECT_EQ(*lru.choose({1, 2, 3}), 3);
  EXPECT_EQ(*lru.choose({2, 1}), 2);
  EXPECT_EQ(*lru.choose({7, 2}), 7) << "an untouched chunk goes before any touched one";
}

}  // namespace
}  // namespace gx
