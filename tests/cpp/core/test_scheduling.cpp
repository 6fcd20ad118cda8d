#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>

#include "core/access_trace.h"
#include "core/belady_eviction.h"
#include "core/prefetch_planner.h"

namespace gx {
namespace {

AccessTrace recorded(const std::vector<ChunkId>& order) {
  AccessTrace t;
  for (ChunkId id : order) t.record(id);
  t.end_iteration();
  return t;
}

TEST(AccessTrace, WarmUpRecordsThenAnIdenticalIterationMatches) {
  AccessTrace t;
  EXPECT_FALSE(t.usable());
  for (ChunkId id : {0, 1, 2, 1, 0}) t.record(id);
  EXPECT_FALSE(t.end_iteration()) << "the warm-up has nothing to match";
  EXPECT_TRUE(t.usable());
  for (ChunkId id : {0, 1, 2, 1, 0}) {
    t.record(id);
    EXPECT_TRUE(t.usable());
  }
  EXPECT_TRUE(t.end_iteration());
  EXPECT_EQ(t.rerecordings(), 0);
  EXPECT_EQ(t.next_use(1, 0), 1u);
  EXPECT_EQ(t.next_use(1, 2), 3u);
  EXPECT_EQ(t.next_use(2, 3), AccessTrace::kNever);
  EXPECT_EQ(t.next_use(9, 0), AccessTrace::kNever);
}

TEST(AccessTrace, AChangedOrderIsDetectedAndReRecorded) {
  AccessTrace t = recorded({0, 1, 2, 3});
  t.record(0);
  t.record(2);  // different control flow
  EXPECT_TRUE(t.diverged());
  EXPECT_FALSE(t.usable());
  t.record(3);
  EXPECT_FALSE(t.end_iteration());
  EXPECT_EQ(t.rerecordings(), 1);
  EXPECT_EQ(t.recorded(), (std::vector<ChunkId>{0, 2, 3}));
  // A shorter or longer iteration with the same prefix is a change too.
  for (ChunkId id : {0, 2, 3, 4}) t.record(id);
  EXPECT_FALSE(t.end_iteration());
  for (ChunkId id : {0, 2, 3}) t.record(id);
  EXPECT_FALSE(t.end_iteration());
  EXPECT_EQ(t.rerecordings(), 3);
}

TEST(BeladyEviction, EvictsTheChunkUsedFarthestAheadAndNeverUsedFirst) {
  AccessTrace t = recorded({0, 1, 2, 3, 2, 1, 0});
  LruEviction lru;
  for (ChunkId id : {0, 1, 2}) {
    t.record(id);
    lru.touch(id);
  }
  // position 3: next uses 0 -> 6, 1 -> 5, 2 -> 4
  EXPECT_EQ(*choose_farthest_next_use({0, 1, 2}, t, lru), 0);
  EXPECT_EQ(*choose_farthest_next_use({1, 2}, t, lru), 1);
  EXPECT_EQ(*choose_farthest_next_use({2, 7}, t, lru), 7) << "never used again goes first";
  EXPECT_FALSE(choose_farthest_next_use({}, t, lru).has_value());
}

TEST(BeladyEviction, FallsBackToLruWithoutAUsableTrace) {
  AccessTrace t;  // warm-up
  LruEviction lru;
  lru.touch(2);
  lru.touch(0);
  lru.touch(1);
  EXPECT_EQ(*choose_farthest_next_use({0, 1, 2}, t, lru), 2);
  AccessTrace d = recorded({0, 1});
  d.record(1);  // diverged
  EXPECT_EQ(*choose_farthest_next_use({0, 1, 2}, d, lru), 2);
}

TEST(PrefetchPlanner, NextMissingChunksWithinCountAndFreeBytes) {
  AccessTrace t = recorded({0, 1, 1, 2, 3, 4, 5});
  t.record(0);
  std::set<ChunkId> resident{0, 3};
  PrefetchQuery q;
  q.max_prefetch = 2;
  q.free_bytes = 1000;
  q.needs_fetch = [&](ChunkId id) { return resident.count(id) == 0; };
  q.chunk_bytes = [](ChunkId) { return int64_t{300}; };
  EXPECT_EQ(plan_prefetch(t, q), (std::vector<ChunkId>{1, 2})) << "distinct, in trace order";
  q.max_prefetch = 5;
  EXPECT_EQ(plan_prefetch(t, q), (std::vector<ChunkId>{1, 2, 4})) << "resident 3 skipped; 1000 bytes hold three";
  q.free_bytes = 299;
  EXPECT_TRUE(plan_prefetch(t, q).empty()) << "bytes, not count, limit the prefetch";
  q.free_bytes = 950;
  q.chunk_bytes = [](ChunkId id) { return id == 2 ? int64_t{900} : int64_t{100}; };
  EXPECT_EQ(plan_prefetch(t, q), (std::vector<ChunkId>{1})) << "stops at the first chunk that does not fit";
  q.max_prefetch = 0;
  EXPECT_TRUE(plan_prefetch(t, q).empty());
  AccessTrace warm;
  q.max_prefetch = 2;
  EXPECT_TRUE(plan_prefetch(warm, q).empty()) << "no trace, no prefetch";
}

}  // namespace
}  // namespace gx
