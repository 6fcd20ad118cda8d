#include <gtest/gtest.h>

#include <memory>

#include "common/manual_event.h"
#include "common/resource_conformance.h"
#include "core/arena_resource.h"
#include "core/chunk_allocator.h"
#include "core/fixed_size_pool.h"
#include "core/resource_adaptors.h"
#include "core/size_class_pool.h"
#include "core/stat.h"

namespace gx {
namespace {

using testing::ResourceConformance;
using testing::ResourceFactory;

INSTANTIATE_TEST_SUITE_P(
    Core, ResourceConformance,
    ::testing::Values(
        ResourceFactory{"host", [](auto& keep) {
                          auto r = std::make_shared<HostMemoryResource>();
                          keep.push_back(r);
                          return r.get();
                        }, 1 << 20, true},
        ResourceFactory{"statistics", [](auto& keep) {
                          auto up = std::make_shared<HostMemoryResource>();
                          auto r = std::make_shared<StatisticsAdaptor>(*up);
                          keep.push_back(up);
                          keep.push_back(r);
                          return r.get();
                        }, 1 << 20, true},
        ResourceFactory{"limiting", [](auto& keep) {
                          auto up = std::make_shared<HostMemoryResource>();
                          auto r = std::make_shared<LimitingAdaptor>(*up, 64 << 20, "test_limit");
                          keep.push_back(up);
                          keep.push_back(r);
                          return r.get();
                        }, 1 << 20, true},
        ResourceFactory{"arena", [](auto& keep) {
                          auto up = std::make_shared<HostMemoryResource>();
                          auto r = std::make_shared<ArenaResource>(*up);
                          r->reserve(4 << 20);
                          keep.push_back(up);
                          keep.push_back(r);
                          return r.get();
                        }, 1 << 20, true},
        ResourceFactory{"fixed_size_pool", [](auto& keep) {
                          auto up = std::make_shared<HostMemoryResource>();
                          auto r = std::make_shared<FixedSizePool>(*up, 1 << 20);
                          keep.push_back(up);
                          keep.push_back(r);
                          return r.get();
                        }, 1 << 20, true},
        ResourceFactory{"size_class_pool", [](auto& keep) {
                          auto up = std::make_shared<HostMemoryResource>();
                          auto r = std::make_shared<SizeClassPool>(*up);
                          keep.push_back(up);
                          keep.push_back(r);
                          return r.get();
                        }, 1 << 20, true}),
    [](const auto& info) { return info.param.name; });

TEST(Stat, TracksCurrentPeakAllocatedFreed) {
  Stat s;
  s.increase(100);
  s.increase(50);
  s.decrease(120);
  s.increase(10);
  EXPECT_EQ(s.current, 40);
  EXPECT_EQ(s.peak, 150);
  EXPECT_EQ(s.allocated, 160);
  EXPECT_EQ(s.freed, 120);
  EXPECT_EQ(s.allocated - s.freed, s.current);
}

TEST(Stat, NeverGoesNegative) {
  Stat s;
  s.increase(10);
  EXPECT_THROW(s.decrease(11), InternalError);
  EXPECT_EQ(s.current, 10);
  EXPECT_THROW(s.increase(-1), InternalError);
}

TEST(StatisticsAdaptor, CountsExactBytes) {
  HostMemoryResource host;
  StatisticsAdaptor stats(host);
  void* a = stats.allocate(1000);
  void* b = stats.allocate(24);
  EXPECT_EQ(stats.bytes().current, 1024);
  EXPECT_EQ(stats.live_allocations(), 2);
  stats.deallocate(a, 1000);
  EXPECT_EQ(stats.bytes().current, 24);
  EXPECT_EQ(stats.bytes().peak, 1024);
  stats.deallocate(b, 24);
  EXPECT_EQ(stats.bytes().current, 0);
  EXPECT_EQ(stats.bytes().freed, 1024);
  EXPECT_EQ(stats.live_allocations(), 0);
}

TEST(LimitingAdaptor, RefusesBeyondLimitWithAClearMessage) {
  HostMemoryResource host;
  LimitingAdaptor limited(host, 1000, "sim_capacity");
  void* a = limited.allocate(600);
  try {
    limited.allocate(500);
    FAIL() << "allocation beyond the limit succeeded";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("500 bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("600 bytes in use"), std::string::npos) << msg;
    EXPECT_NE(msg.find("limit of 1000"), std::string::npos) << msg;
    EXPECT_NE(msg.find("sim_capacity"), std::string::npos) << msg;
  }
  EXPECT_EQ(limited.used_bytes(), 600u);  // the refused request left no trace
  void* b = limited.allocate(400);        // exactly up to the limit is fine
  limited.deallocate(a, 600);
  limited.deallocate(b, 400);
  EXPECT_EQ(limited.used_bytes(), 0u);
}

TEST(FixedSizePool, ReusesSlotsWithoutAskingUpstream) {
  HostMemoryResource host;
  StatisticsAdaptor upstream(host);
  FixedSizePool pool(upstream, 4096);
  void* a = pool.allocate(4096);
  void* b = pool.allocate(100);  // smaller requests take a whole slot
  EXPECT_EQ(pool.upstream_allocations(), 2u);
  EXPECT_EQ(pool.in_use_bytes().current, 8192);
  pool.deallocate(b, 100);
  void* c = pool.allocate(4096);
  EXPECT_EQ(c, b) << "the released slot is handed out again";
  EXPECT_EQ(pool.upstream_allocations(), 2u);
  for (int i = 0; i < 100; ++i) {
    void* p = pool.allocate(4096);
    pool.deallocate(p, 4096);
  }
  EXPECT_EQ(pool.upstream_allocations(), 3u);
  EXPECT_EQ(upstream.bytes().current, 3 * 4096);
  pool.deallocate(a, 4096);
  pool.deallocate(c, 4096);
  EXPECT_EQ(pool.in_use_bytes().current, 0);
  EXPECT_EQ(pool.reserved_bytes(), 3u * 4096);
  pool.release_free_slots();
  EXPECT_EQ(pool.reserved_bytes(), 0u);
  EXPECT_EQ(upstream.bytes().current, 0);
}

TEST(FixedSizePool, ReserveTakesSlotsUpFront) {
  HostMemoryResource host;
  FixedSizePool pool(host, 1024);
  pool.reserve(4);
  EXPECT_EQ(pool.free_slots(), 4u);
  std::vector<void*> ptrs;
  for (int i = 0; i < 4; ++i) ptrs.push_back(pool.allocate(1024));
  EXPECT_EQ(pool.upstream_allocations(), 4u);
  for (void* p : ptrs) pool.deallocate(p, 1024);
}

TEST(FixedSizePool, OversizeRequestIsAUsageErrorDoubleFreeIsABug) {
  HostMemoryResource host;
  FixedSizePool pool(host, 1024);
  EXPECT_THROW(pool.allocate(1025), UsageError);
  void* p = pool.allocate(1024);
  pool.deallocate(p, 1024);
  EXPECT_THROW(pool.deallocate(p, 1024), InternalError);
  int foreign = 0;
  EXPECT_THROW(pool.deallocate(&foreign, 4), InternalError);
}

TEST(FixedSizePool, UpstreamOutOfMemoryLeavesPoolUnchanged) {
  HostMemoryResource host;
  LimitingAdaptor limited(host, 2048, "limit");
  FixedSizePool pool(limited, 1024);
  void* a = pool.allocate(1024);
  void* b = pool.allocate(1024);
  EXPECT_THROW(pool.allocate(1024), OutOfMemoryError);
  EXPECT_EQ(pool.in_use_bytes().current, 2048);
  pool.deallocate(a, 1024);
  EXPECT_NO_THROW(pool.deallocate(pool.allocate(1024), 1024));
  pool.deallocate(b, 1024);
}

TEST(ChunkAllocator, OnePoolPerTierAndSizeExactAccounting) {
  HostMemoryResource device, pinned, pageable;
  ChunkAllocator alloc({&device, &pinned, &pageable});
  void* a = alloc.allocate(Tier::kDevice, 1000);
  void* b = alloc.allocate(Tier::kDevice, 2000);
  void* c = alloc.allocate(Tier::kPinnedHost, 1000);
  EXPECT_EQ(alloc.in_use_bytes(Tier::kDevice).current, 3000);
  EXPECT_EQ(alloc.in_use_bytes(Tier::kPinnedHost).current, 1000);
  EXPECT_EQ(alloc.in_use_bytes(Tier::kPageableHost).current, 0);
  alloc.deallocate(Tier::kDevice, a, 1000);
  void* d = alloc.allocate(Tier::kDevice, 1000);
  EXPECT_EQ(d, a);
  EXPECT_EQ(alloc.upstream_allocations(Tier::kDevice), 2u);
  EXPECT_EQ(alloc.reserved_bytes(Tier::kDevice).current, 3000) << "growth extents of exactly the slot size";
  EXPECT_EQ(alloc.in_use_bytes(Tier::kDevice).peak, 3000);
  alloc.deallocate(Tier::kDevice, b, 2000);
  alloc.deallocate(Tier::kDevice, d, 1000);
  alloc.deallocate(Tier::kPinnedHost, c, 1000);
  EXPECT_EQ(alloc.in_use_bytes(Tier::kDevice).current, 0);
  alloc.release_free_slots();  // back to the arena, which keeps its extents
  EXPECT_EQ(alloc.reserved_bytes(Tier::kDevice).current, 3000);
  EXPECT_EQ(alloc.trim(Tier::kDevice), 3000u);
  EXPECT_EQ(alloc.reserved_bytes(Tier::kDevice).current, 0);
}

TEST(ChunkAllocator, CachedSlotsOfOneSizeDoNotStarveAnother) {
  HostMemoryResource host;
  LimitingAdaptor device(host, 4096, "limit");
  HostMemoryResource pinned, pageable;
  ChunkAllocator alloc({&device, &pinned, &pageable});
  void* a = alloc.allocate(Tier::kDevice, 1024);
  void* b = alloc.allocate(Tier::kDevice, 1024);
  alloc.deallocate(Tier::kDevice, a, 1024);
  alloc.deallocate(Tier::kDevice, b, 1024);  // 2 KiB cached in the 1 KiB pool
  void* c = alloc.allocate(Tier::kDevice, 4096);  // needs the cached bytes back
  EXPECT_EQ(alloc.reserved_bytes(Tier::kDevice).current, 4096);
  EXPECT_THROW(alloc.allocate(Tier::kDevice, 1024), OutOfMemoryError);
  EXPECT_EQ(alloc.in_use_bytes(Tier::kDevice).current, 4096) << "a failed allocation changes nothing";
  alloc.deallocate(Tier::kDevice, c, 4096);
}

TEST(ChunkAllocator, MissingTierIsAUsageError) {
  HostMemoryResource device, pageable;
  ChunkAllocator alloc({&device, nullptr, &pageable});
  EXPECT_FALSE(alloc.has_tier(Tier::kPinnedHost));
  EXPECT_THROW(alloc.allocate(Tier::kPinnedHost, 64), UsageError);
}

// --- the reserved arena ------------------------------------------------------------------------

TEST(ArenaResource, CarvesTheReservationFirstFitAndCoalesces) {
  HostMemoryResource host;
  StatisticsAdaptor upstream(host);
  ArenaResource arena(upstream);
  arena.reserve(10000);  // rounded up to 10240
  EXPECT_EQ(upstream.live_allocations(), 1);
  EXPECT_EQ(arena.reserved_bytes().current, 10240);
  auto* a = static_cast<char*>(arena.allocate(1000));  // 1024
  auto* b = static_cast<char*>(arena.allocate(2048));
  auto* c = static_cast<char*>(arena.allocate(3000));  // 3072
  EXPECT_EQ(b, a + 1024) << "blocks are carved in address order from the reservation";
  EXPECT_EQ(c, b + 2048);
  EXPECT_EQ(upstream.live_allocations(), 1) << "served from the reservation";
  EXPECT_EQ(arena.in_use_bytes().current, 1024 + 2048 + 3072);
  arena.deallocate(a, 1000);
  arena.deallocate(c, 3000);  // coalesces with the tail
  EXPECT_EQ(arena.largest_free_block(), 10240u - 1024 - 2048);
  arena.deallocate(b, 2048);  // everything coalesces into one range again
  EXPECT_EQ(arena.largest_free_block(), 10240u);
  EXPECT_EQ(arena.in_use_bytes().current, 0);
  EXPECT_EQ(arena.in_use_bytes().peak, 1024 + 2048 + 3072);
  void* whole = arena.allocate(10240);
  EXPECT_EQ(whole, a);
  arena.deallocate(whole, 10240);
}

TEST(ArenaResource, GrowsByExactExtentsAndTrimsWhollyFreeOnes) {
  HostMemoryResource host;
  StatisticsAdaptor upstream(host);
  ArenaResource arena(upstream);
  arena.reserve(4096);
  void* a = arena.allocate(4096);
  void* b = arena.allocate(8192);  // no room: a growth extent of exactly the request
  EXPECT_EQ(arena.extents(), 2u);
  EXPECT_EQ(arena.reserved_bytes().current, 4096 + 8192);
  EXPECT_EQ(arena.trim(), 0u) << "no extent is wholly free";
  arena.deallocate(b, 8192);
  EXPECT_EQ(arena.trim(), 8192u);
  EXPECT_EQ(arena.extents(), 1u);
  EXPECT_EQ(upstream.bytes().current, 4096);
  arena.deallocate(a, 4096);
  EXPECT_EQ(arena.trim(), 4096u) << "the reservation too, once wholly free";
  EXPECT_EQ(upstream.bytes().current, 0);
}

TEST(ArenaResource, AnUnroundedFitTakesTheWholeRangeSoBlocksStayAligned) {
  HostMemoryResource host;
  ArenaResource arena(host);
  void* a = arena.allocate(1000);  // a growth extent of exactly 1000 bytes
  arena.deallocate(a, 1000);
  void* b = arena.allocate(900);   // fits only unrounded (1024 > 1000): takes the whole range
  EXPECT_EQ(b, a);
  EXPECT_EQ(arena.in_use_bytes().current, 1000);
  EXPECT_EQ(arena.largest_free_block(), 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % kResourceAlignmentBytes, 0u);
  arena.deallocate(b, 900);
  EXPECT_EQ(arena.extents(), 1u);
}

TEST(ArenaResource, DoubleFreeAndWrongSizeAreBugs) {
  HostMemoryResource host;
  ArenaResource arena(host);
  void* a = arena.allocate(1024);
  EXPECT_THROW(arena.deallocate(a, 4096), InternalError);
  arena.deallocate(a, 1024);
  EXPECT_THROW(arena.deallocate(a, 1024), InternalError);
}

// --- stream-safe reuse --------------------------------------------------------------------------

using FakeEvent = testing::ManualEvent;

TEST(FixedSizePool, ReusesAFreedSlotOnlyAfterItsLastUsesOrOrderedAfterThem) {
  HostMemoryResource host;
  FixedSizePool pool(host, 1024);
  void* a = pool.allocate(1024);
  void* b = pool.allocate(1024);
  auto busy = std::make_shared<FakeEvent>();
  auto done = std::make_shared<FakeEvent>();
  done->done = true;
  pool.deallocate_after(a, 1024, {done});
  pool.deallocate_after(b, 1024, {busy});  // most recently freed, but still in use
  FixedSizePool::Ordered first = pool.allocate_ordered(1024);
  EXPECT_EQ(first.ptr, a) << "a slot whose last uses completed comes first";
  EXPECT_TRUE(first.wait_for.empty());
  FixedSizePool::Ordered second = pool.allocate_ordered(1024);
  EXPECT_EQ(second.ptr, b) << "a busy slot is handed out with its events rather than growing the pool";
  ASSERT_EQ(second.wait_for.size(), 1u);
  EXPECT_EQ(second.wait_for[0], busy);
  EXPECT_EQ(busy->waits, 0) << "allocate_ordered never blocks";
  EXPECT_EQ(pool.upstream_allocations(), 2u);
  EXPECT_EQ(pool.ordered_reuses(), 1u);
  pool.deallocate_after(second.ptr, 1024, {busy});
  void* plain = pool.allocate(1024);  // the plain interface waits itself
  EXPECT_EQ(plain, b);
  EXPECT_EQ(busy->waits, 1);
  EXPECT_EQ(pool.reuse_waits(), 1u);
  pool.deallocate(plain, 1024);
  pool.deallocate(first.ptr, 1024);
}

TEST(FixedSizePool, ReleasingFreeSlotsWaitsForTheirLastUses) {
  HostMemoryResource host;
  StatisticsAdaptor upstream(host);
  FixedSizePool pool(upstream, 1024);
  auto busy = std::make_shared<FakeEvent>();
  pool.deallocate_after(pool.allocate(1024), 1024, {busy});
  pool.release_free_slots();
  EXPECT_EQ(busy->waits, 1);
  EXPECT_EQ(upstream.bytes().current, 0);
}

TEST(ChunkAllocator, ReservedArenaServesSlotsAndOrderedReuseIsCounted) {
  HostMemoryResource device, pinned, pageable;
  StatisticsAdaptor device_stats(device);
  ChunkAllocator alloc({&device_stats, &pinned, &pageable});
  alloc.reserve_arena(Tier::kDevice, 4 * 4096);
  std::vector<void*> slots;
  for (int i = 0; i < 4; ++i) slots.push_back(alloc.allocate(Tier::kDevice, 4096));
  EXPECT_EQ(device_stats.live_allocations(), 1) << "four slots, one upstream allocation";
  EXPECT_EQ(alloc.arena_extents(Tier::kDevice), 1u);
  auto busy = std::make_shared<FakeEvent>();
  alloc.deallocate_after(Tier::kDevice, slots[3], 4096, {busy});
  FixedSizePool::Ordered again = alloc.allocate_ordered(Tier::kDevice, 4096);
  EXPECT_EQ(again.ptr, slots[3]);
  EXPECT_EQ(again.wait_for.size(), 1u);
  EXPECT_EQ(alloc.ordered_reuses(Tier::kDevice), 1u);
  EXPECT_EQ(alloc.in_use_bytes(Tier::kDevice).current, 4 * 4096);
  for (void* p : {slots[0], slots[1], slots[2], again.ptr}) alloc.deallocate(Tier::kDevice, p, 4096);
  EXPECT_EQ(alloc.trim(Tier::kDevice), 4u * 4096);
  EXPECT_EQ(device_stats.live_allocations(), 0);
}

}  // namespace
}  // namespace gx
