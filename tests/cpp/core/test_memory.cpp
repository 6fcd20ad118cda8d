#include <gtest/gtest.h>

#include <memory>

#include "common/resource_conformance.h"
#include "core/chunk_allocator.h"
#include "core/fixed_size_pool.h"
#include "core/resource_adaptors.h"
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
                        }, 1 << 20},
        ResourceFactory{"statistics", [](auto& keep) {
                          auto up = std::make_shared<HostMemoryResource>();
                          auto r = std::make_shared<StatisticsAdaptor>(*up);
                          keep.push_back(up);
                          keep.push_back(r);
                          return r.get();
                        }, 1 << 20},
        ResourceFactory{"limiting", [](auto& keep) {
                          auto up = std::make_shared<HostMemoryResource>();
                          auto r = std::make_shared<LimitingAdaptor>(*up, 64 << 20, "test_limit");
                          keep.push_back(up);
                          keep.push_back(r);
                          return r.get();
                        }, 1 << 20},
        ResourceFactory{"fixed_size_pool", [](auto& keep) {
                          auto up = std::make_shared<HostMemoryResource>();
                          auto r = std::make_shared<FixedSizePool>(*up, 1 << 20);
                          keep.push_back(up);
                          keep.push_back(r);
                          return r.get();
                        }, 1 << 20}),
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
  EXPECT_EQ(alloc.reserved_bytes(Tier::kDevice).current, 3000);
  EXPECT_EQ(alloc.in_use_bytes(Tier::kDevice).peak, 3000);
  alloc.deallocate(Tier::kDevice, b, 2000);
  alloc.deallocate(Tier::kDevice, d, 1000);
  alloc.deallocate(Tier::kPinnedHost, c, 1000);
  EXPECT_EQ(alloc.in_use_bytes(Tier::kDevice).current, 0);
  alloc.release_free_slots();
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

}  // namespace
}  // namespace gx
