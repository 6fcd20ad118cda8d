// SizeClassPool: classes, reuse without upstream calls, stream-ordered reuse, release.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "common/manual_event.h"
#include "core/resource_adaptors.h"
#include "core/size_class_pool.h"

namespace gx {
namespace {

using PendingCopy = testing::ManualEvent;

TEST(SizeClassPool, ClassesRoundUpAtMostAQuarterAndKeepTheAlignment) {
  EXPECT_EQ(SizeClassPool::class_bytes(1), kResourceAlignmentBytes);
  EXPECT_EQ(SizeClassPool::class_bytes(256), 256u);
  EXPECT_EQ(SizeClassPool::class_bytes(1 << 20), size_t{1} << 20);
  EXPECT_EQ(SizeClassPool::class_bytes((1 << 20) + 1), (size_t{1} << 20) + (size_t{1} << 18));
  for (size_t bytes : {257ul, 1000ul, 4097ul, 3'000'000ul, 123'456'789ul}) {
    const size_t slot = SizeClassPool::class_bytes(bytes);
    EXPECT_GE(slot, bytes);
    EXPECT_LE(slot, bytes + bytes / 4 + kResourceAlignmentBytes) << bytes;
    EXPECT_EQ(slot % kResourceAlignmentBytes, 0u) << bytes;
  }
  EXPECT_THROW(SizeClassPool::class_bytes(0), UsageError);
}

TEST(SizeClassPool, ASecondStepOfTheSameSizesAsksTheUpstreamForNothing) {
  HostMemoryResource host;
  StatisticsAdaptor upstream(host);
  SizeClassPool pool(upstream);
  const std::vector<size_t> step = {3 << 20, 3 << 20, 5000, (3 << 20) - 7};  // the last shares a class
  for (int round = 0; round < 3; ++round) {
    std::vector<void*> held;
    for (size_t bytes : step) held.push_back(pool.allocate(bytes));
    EXPECT_EQ(pool.in_use_bytes().current, 3 * (3 << 20) + static_cast<int64_t>(SizeClassPool::class_bytes(5000)));
    for (size_t i = 0; i < step.size(); ++i) pool.deallocate(held[i], step[i]);
  }
  EXPECT_EQ(pool.upstream_allocations(), 4u) << "slots reused across steps";
  EXPECT_EQ(pool.in_use_bytes().current, 0);
  EXPECT_TRUE(pool.has_free_slot(3 << 20));
  EXPECT_FALSE(pool.has_free_slot(7 << 20));
  pool.release_free();
  EXPECT_EQ(upstream.bytes().current, 0);
  EXPECT_EQ(pool.reserved_bytes(), 0u);
}

TEST(SizeClassPool, ABufferStillCopiedIsHandedOutWithItsEventsNeverWaitedOnByTheHost) {
  HostMemoryResource host;
  SizeClassPool pool(host);
  FixedSizePool::Ordered first = pool.allocate_ordered(1 << 20);
  auto copy = std::make_shared<PendingCopy>();
  pool.deallocate_after(first.ptr, 1 << 20, {copy});
  FixedSizePool::Ordered again = pool.allocate_ordered(1 << 20);
  EXPECT_EQ(again.ptr, first.ptr) << "the pool does not grow because a buffer is busy";
  ASSERT_EQ(again.wait_for.size(), 1u);
  EXPECT_EQ(copy->waits, 0);
  EXPECT_EQ(pool.ordered_reuses(), 1u);
  pool.deallocate_after(again.ptr, 1 << 20, {copy});
  pool.release_free();  // giving a buffer back waits for its copies
  EXPECT_EQ(copy->waits, 1);
}

TEST(SizeClassPool, AnUpstreamRefusalChangesNothing) {
  HostMemoryResource host;
  LimitingAdaptor limited(host, 2 << 20, "test_limit");
  SizeClassPool pool(limited);
  void* a = pool.allocate(2 << 20);
  EXPECT_THROW(pool.allocate(1 << 20), OutOfMemoryError);
  EXPECT_EQ(pool.in_use_bytes().current, 2 << 20);
  pool.deallocate(a, 2 << 20);
  EXPECT_EQ(pool.in_use_bytes().current, 0);
}

}  // namespace
}  // namespace gx
