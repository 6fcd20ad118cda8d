// The process-wide allocator (GEMINI_EXT_ALLOCATOR=chunk) on a real GPU, without torch: exact
// statistics, stream-ordered reuse, record_stream, the memory-fraction limit and the
// memory-pressure path (a registered reclaimer frees device memory and the allocation that
// would have failed succeeds). Every test skips itself without a CUDA device.
#include <gtest/gtest.h>

#include "core/memory_pressure.h"
#include "cuda/cuda_backend.h"
#include "cuda/process_allocator.h"

namespace gx {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device"

TEST(ProcessAllocator, CountsExactBytesAndReusesOnTheSameStream) {
  SKIP_WITHOUT_GPU();
  ProcessAllocator& a = ProcessAllocator::instance();
  const ProcessAllocatorStats before = a.stats();
  void* p = a.allocate(3 << 20, 0, nullptr);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(a.stats().allocated_bytes.current - before.allocated_bytes.current, 3 << 20);
  a.free(p, 3 << 20, 0, nullptr);
  const int64_t reserved = a.stats().reserved_bytes;
  void* q = a.allocate(3 << 20, 0, nullptr);
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(a.stats().reserved_bytes, reserved) << "a freed block is reused in stream order: the pool did not grow";
  a.free(q, 3 << 20, 0, nullptr);
  const ProcessAllocatorStats after = a.stats();
  EXPECT_EQ(after.allocated_bytes.current, before.allocated_bytes.current);
  EXPECT_EQ(after.allocations - before.allocations, 2);
  EXPECT_EQ(after.frees - before.frees, 2);
  EXPECT_EQ(a.allocate(0, 0, nullptr), nullptr);
}

TEST(ProcessAllocator, RecordStreamOrdersTheFreeAfterTheOtherStream) {
  SKIP_WITHOUT_GPU();
  ProcessAllocator& a = ProcessAllocator::instance();
  cudaStream_t side = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  const int64_t records = a.stats().record_streams;
  void* p = a.allocate(1 << 20, 0, nullptr);
  ASSERT_EQ(cudaMemsetAsync(p, 1, 1 << 20, side), cudaSuccess);
  a.record_stream(p, side);
  a.record_stream(p, side);  // once per stream
  EXPECT_EQ(a.stats().record_streams - records, 1);
  a.free(p, 1 << 20, 0, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(side), cudaSuccess);
}

TEST(ProcessAllocator, TheFractionLimitAsksReclaimersAndFailsCleanlyWithoutThem) {
  SKIP_WITHOUT_GPU();
  ProcessAllocator& a = ProcessAllocator::instance();
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  // A limit of what is in use now plus 64 MiB (chunk slots count too: none here).
  const double fraction =
      static_cast<double>(a.stats().allocated_bytes.current + (int64_t{64} << 20)) / static_cast<double>(total_bytes);
  a.set_memory_fraction(fraction, 0);
  const size_t limit = a.limit_bytes(0);
  void* held = a.allocate(48 << 20, 0, nullptr);
  ASSERT_NE(held, nullptr);
  const ProcessAllocatorStats s0 = a.stats();
  EXPECT_EQ(a.allocate(32 << 20, 0, nullptr), nullptr) << "past the limit and nothing can be reclaimed";
  EXPECT_EQ(a.stats().ooms_failed - s0.ooms_failed, 1);
  // A reclaimer that frees what it holds: the same allocation now succeeds.
  int calls = 0;
  const int id = MemoryPressure::instance().add_reclaimer(0, [&](size_t) -> size_t {
    calls += 1;
    if (held == nullptr) return 0;
    a.free(held, 48 << 20, 0, nullptr);
    held = nullptr;
    return 48 << 20;
  });
  void* p = a.allocate(32 << 20, 0, nullptr);
  MemoryPressure::instance().remove_reclaimer(id);
  EXPECT_NE(p, nullptr);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(a.stats().ooms_rescued - s0.ooms_rescued, 1);
  EXPECT_EQ(a.stats().reclaimed_bytes - s0.reclaimed_bytes, 48 << 20);
  EXPECT_EQ(a.limit_bytes(0), limit);
  a.free(p, 32 << 20, 0, nullptr);
  a.set_memory_fraction(1.0, 0);
  EXPECT_GT(a.empty_cache(), 0u) << "the cached blocks go back to the device";
}

}  // namespace
}  // namespace gx

#undef SKIP_WITHOUT_GPU  // a unity build compiles the next test file in this unit
