#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "common/backend_conformance.h"
#include "core/sim_backend.h"

namespace gx {
namespace {

using testing::BackendConformance;
using testing::BackendFactory;

INSTANTIATE_TEST_SUITE_P(
    Sim, BackendConformance,
    ::testing::Values(BackendFactory{"sim", [] { return std::make_unique<SimBackend>(SimConfig{64 << 20, 0, 0}); }},
                      BackendFactory{"sim_random_delay",
                                     [] { return std::make_unique<SimBackend>(SimConfig{64 << 20, 300, 7}); }}),
    [](const auto& info) { return info.param.name; });

// A copy queued behind an event that has not completed must not run; once the event completes,
// a read after the copy's own event sees the copied bytes.
TEST(SimBackend, ReadAfterAsyncCopySeesCopiedBytesOnlyAfterItsEvent) {
  SimBackend sim(SimConfig{1 << 20, 0, 0});
  auto gate = std::make_shared<SimEvent>();
  std::vector<uint8_t> src(4096, 0xAB), dst(4096, 0x00);
  sim.stream_wait_event(StreamKind::kHostToDevice, gate);
  sim.copy_async(dst.data(), src.data(), src.size(), StreamKind::kHostToDevice);
  auto copied = sim.record_event(StreamKind::kHostToDevice);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(copied->query());
  EXPECT_EQ(dst[0], 0x00) << "the copy ran before the event it waits on";
  gate->complete();
  copied->synchronize();
  EXPECT_TRUE(copied->query());
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), src.size()), 0);
}

TEST(SimBackend, ComputeStreamIsTheCallingThread) {
  SimBackend sim(SimConfig{1 << 20, 1000, 1});
  std::vector<uint8_t> src(128, 3), dst(128, 0);
  sim.copy_async(dst.data(), src.data(), src.size(), StreamKind::kCompute);
  EXPECT_EQ(dst[127], 3);  // done on return
  EXPECT_TRUE(sim.record_event(StreamKind::kCompute)->query());
}

TEST(SimBackend, CompletedCopiesAreVisibleAcrossStreamsThroughEvents) {
  SimBackend sim(SimConfig{1 << 20, 200, 3});
  std::vector<uint8_t> a(1 << 16, 1), b(1 << 16, 0), c(1 << 16, 0);
  sim.copy_async(b.data(), a.data(), a.size(), StreamKind::kHostToDevice);
  sim.stream_wait_event(StreamKind::kDeviceToHost, sim.record_event(StreamKind::kHostToDevice));
  sim.copy_async(c.data(), b.data(), b.size(), StreamKind::kDeviceToHost);
  sim.synchronize(StreamKind::kDeviceToHost);
  EXPECT_EQ(c, a);
}

TEST(SimBackend, CapacityIsEnforcedAndReported) {
  SimBackend sim(SimConfig{4096, 0, 0});
  void* p = sim.device_memory().allocate(4096);
  EXPECT_EQ(sim.device_used_bytes(), 4096u);
  EXPECT_THROW(sim.device_memory().allocate(1), OutOfMemoryError);
  sim.device_memory().deallocate(p, 4096);
  EXPECT_EQ(sim.device_used_bytes(), 0u);
}

TEST(SimBackend, ZeroCapacityIsRefused) { EXPECT_THROW(SimBackend(SimConfig{0, 0, 0}), UsageError); }

}  // namespace
}  // namespace gx
