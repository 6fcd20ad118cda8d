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

namespace gx {
namespace {

// A device of `budget` equal-size chunk slots driven by a trace, the way the manager uses the
// policies: before each access, prefetch (if enabled) what fits; on a miss, evict by farthest
// next use until the chunk fits. `in_compute` is the chunk being used (never evicted).
struct Replay {
  std::vector<std::string> events;  // "F<id>" fetch on miss, "P<id>" prefetch, "E<id>" evict, "H<id>" hit
  size_t max_resident = 0;
};

Replay replay(const std::vector<ChunkId>& warmup, const std::vector<ChunkId>& order, size_t budget, int max_prefetch) {
  AccessTrace trace;
  for (ChunkId id : warmup) trace.record(id);
  trace.end_iteration();
  LruEviction lru;
  std::set<ChunkId> resident;
  Replay r;
  auto make_room = [&](ChunkId keep) {
    while (resident.size() >= budget) {
      std::vector<ChunkId> candidates;
      for (ChunkId c : resident)
        if (c != keep) candidates.push_back(c);
      auto victim = choose_farthest_next_use(candidates, trace, lru);
      EXPECT_TRUE(victim.has_value());
      resident.erase(*victim);
      r.events.push_back("E" + std::to_string(*victim));
    }
  };
  for (ChunkId id : order) {
    trace.record(id);
    if (resident.count(id)) {
      r.events.push_back("H" + std::to_string(id));
    } else {
      make_room(id);
      resident.insert(id);
      r.events.push_back("F" + std::to_string(id));
    }
    lru.touch(id);
    r.max_resident = std::max(r.max_resident, resident.size());
    PrefetchQuery q;
    q.max_prefetch = max_prefetch;
    q.free_bytes = static_cast<int64_t>(budget - resident.size());
    q.needs_fetch = [&](ChunkId c) { return resident.count(c) == 0; };
    q.chunk_bytes = [](ChunkId) { return int64_t{1}; };
    for (ChunkId p : plan_prefetch(trace, q)) {
      resident.insert(p);
      r.events.push_back("P" + std::to_string(p));
    }
    r.max_resident = std::max(r.max_resident, resident.size());
  }
  return r;
}

TEST(SchedulerReplay, ForwardThenBackwardUnderTwoSlotsEvictsFarthestNextUse) {
  const std::vector<ChunkId> iter{0, 1, 2, 3, 3, 2, 1, 0};
  Replay r = replay(iter, iter, /*budget=*/2, /*max_prefetch=*/0);
  EXPECT_EQ(r.events, (std::vector<std::string>{"F0", "F1", "E0", "F2", "E1", "F3", "H3", "H2", "E3", "F1", "E2",
                                                "F0"}))
      << "0 is needed last, so it goes first; 3 is never needed again after its backward";
  EXPECT_LE(r.max_resident, 2u);
}

TEST(SchedulerReplay, PrefetchFillsOnlyFreeSlotsAndNeverExceedsTheBudget) {
  const std::vector<ChunkId> iter{0, 1, 2, 3, 3, 2, 1, 0};
  Replay r = replay(iter, iter, /*budget=*/3, /*max_prefetch=*/2);
  EXPECT_EQ(r.events, (std::vector<std::string>{"F0", "P1", "P2", "H1", "H2", "E0", "F3", "H3", "H2", "H1", "E3",
                                                "F0"}));
  EXPECT_LE(r.max_resident, 3u);
  Replay again = replay(iter, iter, 3, 2);
  EXPECT_EQ(again.events, r.events) << "deterministic";
}

TEST(SchedulerReplay, ADivergedIterationFallsBackToLruAndStopsPrefetching) {
  const std::vector<ChunkId> recorded{0, 1, 2, 3, 3, 2, 1, 0};
  const std::vector<ChunkId> other{0, 2, 1, 3};  // different control flow
  Replay r = replay(recorded, other, /*budget=*/2, /*max_prefetch=*/2);
  // 0 fetched, then prefetch is still on the recorded path (1); at 2 the order diverges: from
  // there LRU decides and nothing more is prefetched. The speculative 1 was never used, so it
  // is the least recently used and goes first; then 0, then 2.
  EXPECT_EQ(r.events, (std::vector<std::string>{"F0", "P1", "E1", "F2", "E0", "F1", "E2", "F3"}));
  EXPECT_LE(r.max_resident, 2u);
}

}  // namespace
}  // namespace gx
