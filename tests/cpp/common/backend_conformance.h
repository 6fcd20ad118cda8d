// One conformance suite for every DeviceBackend: instantiated for `sim` in tests/cpp/core and
// for `cuda` in tests/cpp/cuda. Device memory is only read back through copies, so the same
// tests run whether the device is host memory or a GPU.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "core/device_backend.h"
#include "core/errors.h"

namespace gx::testing {

struct BackendFactory {
  std::string name;
  std::function<std::unique_ptr<DeviceBackend>()> make;
};

class BackendConformance : public ::testing::TestWithParam<BackendFactory> {
 protected:
  // A factory returns null when its device is absent (no GPU): the test is skipped.
  void SetUp() override {
    backend_ = GetParam().make();
    if (!backend_) GTEST_SKIP() << GetParam().name << ": device not present";
  }
  void TearDown() override {
    if (backend_) backend_->synchronize_all();
  }
  std::unique_ptr<DeviceBackend> backend_;
};

inline std::vector<uint8_t> pattern(size_t bytes, uint8_t seed) {
  std::vector<uint8_t> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<uint8_t>(seed + i * 131u);
  return v;
}

// H2D then D2H, ordered only by an event between the two side streams.
TEST_P(BackendConformance, RoundTripThroughDeviceIsOrderedByEvents) {
  constexpr size_t kBytes = 1 << 20;  // 1 MiB
  void* dev = backend_->device_memory().allocate(kBytes);
  void* host_in = backend_->host_memory().allocate(kBytes);
  void* host_out = backend_->host_memory().allocate(kBytes);
  for (uint8_t round = 0; round < 20; ++round) {
    auto src = pattern(kBytes, round);
    std::memcpy(host_in, src.data(), kBytes);
    std::memset(host_out, 0xEE, kBytes);
    backend_->copy_async(dev, host_in, kBytes, StreamKind::kHostToDevice);
    backend_->stream_wait_event(StreamKind::kDeviceToHost, backend_->record_event(StreamKind::kHostToDevice));
    backend_->copy_async(host_out, dev, kBytes, StreamKind::kDeviceToHost);
    auto done = backend_->record_event(StreamKind::kDeviceToHost);
    done->synchronize();
    EXPECT_TRUE(done->query());
    ASSERT_EQ(std::memcmp(host_out, src.data(), kBytes), 0) << "round " << int(round);
    // The next round overwrites host_in: the H2D of this round is long done (event chain).
  }
  backend_->device_memory().deallocate(dev, kBytes);
  backend_->host_memory().deallocate(host_in, kBytes);
  backend_->host_memory().deallocate(host_out, kBytes);
}

// Copies on one stream run in submission order: the last write wins.
TEST_P(BackendConformance, OneStreamRunsInSubmissionOrder) {
  constexpr size_t kBytes = 64 << 10;
  void* dev = backend_->device_memory().allocate(kBytes);
  std::vector<void*> hosts;
  for (uint8_t i = 0; i < 8; ++i) {
    void* h = backend_->host_memory().allocate(kBytes);
    auto p = pattern(kBytes, i);
    std::memcpy(h, p.data(), kBytes);
    hosts.push_back(h);
    backend_->copy_async(dev, h, kBytes, StreamKind::kHostToDevice);
  }
  void* out = backend_->host_memory().allocate(kBytes);
  backend_->stream_wait_event(StreamKind::kDeviceToHost, backend_->record_event(StreamKind::kHostToDevice));
  backend_->copy_async(out, dev, kBytes, StreamKind::kDeviceToHost);
  backend_->synchronize(StreamKind::kDeviceToHost);
  auto last = pattern(kBytes, 7);
  EXPECT_EQ(std::memcmp(out, last.data(), kBytes), 0);
  for (void* h : hosts) backend_->host_memory().deallocate(h, kBytes);
  backend_->host_memory().deallocate(out, kBytes);
  backend_->device_memory().deallocate(dev, kBytes);
}

// zero_async zeroes device memory in its stream's order: after a copy of a pattern, before a
// copy back.
TEST_P(BackendConformance, ZeroAsyncZeroesInStreamOrder) {
  constexpr size_t kBytes = 1 << 20;
  void* dev = backend_->device_memory().allocate(kBytes);
  void* host = backend_->host_memory().allocate(kBytes);
  auto src = pattern(kBytes, 3);
  std::memcpy(host, src.data(), kBytes);
  backend_->copy_async(dev, host, kBytes, StreamKind::kHostToDevice);
  backend_->zero_async(static_cast<uint8_t*>(dev) + 4096, kBytes - 8192, StreamKind::kHostToDevice);
  backend_->stream_wait_event(StreamKind::kDeviceToHost, backend_->record_event(StreamKind::kHostToDevice));
  backend_->synchronize(StreamKind::kHostToDevice);  // the H2D copy reads `host`: reuse it after
  std::memset(host, 0xEE, kBytes);
  backend_->copy_async(host, dev, kBytes, StreamKind::kDeviceToHost);
  backend_->synchronize(StreamKind::kDeviceToHost);
  const auto* out = static_cast<const uint8_t*>(host);
  EXPECT_EQ(std::memcmp(out, src.data(), 4096), 0) << "bytes before the zeroed range keep the copy";
  EXPECT_EQ(std::memcmp(out + kBytes - 4096, src.data() + kBytes - 4096, 4096), 0);
  for (size_t i = 4096; i < kBytes - 4096; ++i) ASSERT_EQ(out[i], 0) << i;
  backend_->device_memory().deallocate(dev, kBytes);
  backend_->host_memory().deallocate(host, kBytes);
}

// The compute stream waiting on a copy's event sees the copied bytes.
TEST_P(BackendConformance, ComputeWaitingOnEventSeesCopy) {
  constexpr size_t kBytes = 256 << 10;
  void* dev = backend_->device_memory().allocate(kBytes);
  void* host = backend_->host_memory().allocate(kBytes);
  void* back = backend_->host_memory().allocate(kBytes);
  auto p = pattern(kBytes, 42);
  std::memcpy(host, p.data(), kBytes);
  backend_->copy_async(dev, host, kBytes, StreamKind::kHostToDevice);
  backend_->stream_wait_event(StreamKind::kCompute, backend_->record_event(StreamKind::kHostToDevice));
  backend_->copy_async(back, dev, kBytes, StreamKind::kCompute);
  backend_->synchronize(StreamKind::kCompute);
  EXPECT_EQ(std::memcmp(back, p.data(), kBytes), 0);
  backend_->device_memory().deallocate(dev, kBytes);
  backend_->host_memory().deallocate(host, kBytes);
  backend_->host_memory().deallocate(back, kBytes);
}

TEST_P(BackendConformance, DeviceMemoryBeyondCapacityIsOutOfMemory) {
  const size_t too_much = backend_->device_capacity_bytes() + (size_t{1} << 20);
  try {
    void* p = backend_->device_memory().allocate(too_much);
    backend_->device_memory().deallocate(p, too_much);
    FAIL() << "allocating " << too_much << " bytes beyond the capacity succeeded";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(too_much)), std::string::npos) << e.what();
  }
}

TEST_P(BackendConformance, EventOfIdleStreamCompletes) {
  for (int s = 0; s < kNumStreams; ++s) {
    auto e = backend_->record_event(static_cast<StreamKind>(s));
    e->synchronize();
    EXPECT_TRUE(e->query());
  }
}

}  // namespace gx::testing
