// SimBackend: a simulated device made of host memory, so every scheduling path runs without a GPU.
//
// Design note. The device tier is host memory under a LimitingAdaptor of `capacity_bytes`, so
// it runs out of memory exactly where a GPU of that size would. kHostToDevice and
// kDeviceToHost are each a worker thread draining a FIFO of tasks, so copies really are
// asynchronous: a caller that reads a destination before waiting on the copy's event can see
// stale bytes, which is what the ordering tests check. `max_copy_delay_us` makes each copy sleep
// a random time first (seeded, reproducible), to shake out missing waits. kCompute is the
// calling thread: a copy on it is a plain memcpy, its events are complete when recorded, and
// waiting on an event from it blocks the caller, just as compute on the CPU must.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <random>

#include "device_backend.h"
#include "serial_executor.h"
#include "resource_adaptors.h"

namespace gx {

struct SimConfig {
  size_t capacity_bytes = size_t{1} << 30;  // bytes of the simulated device
  int64_t max_copy_delay_us = 0;            // each async copy sleeps uniform [0, max] microseconds
  uint64_t seed = 0;
};

class SimEvent final : public Event {
 public:
  bool query() const override;
  void synchronize() override;
  double seconds_after(const Event& earlier) const override;
  void complete();

 private:
  mutable std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::chrono::steady_clock::time_point done_at_;
};

class SimBackend final : public DeviceBackend {
 public:
  explicit SimBackend(SimConfig config);
  ~SimBackend() override;

  std::string name() const override { return "sim"; }
  size_t device_capacity_bytes() const override { return config_.capacity_bytes; }
  MemoryResource& device_memory() override { return device_limited_; }
  MemoryResource& host_memory() override { return host_; }
  bool host_memory_is_pinned() const override { return false; }
  void* device_address_of_host(void* host_ptr) const override { return host_ptr; }

  void copy_async(void* dst, const void* src, size_t bytes, StreamKind stream) override;
  void zero_async(void* dst, size_t bytes, StreamKind stream) override;
  std::shared_ptr<Event> record_event(StreamKind stream) override;
  void stream_wait_event(StreamKind stream, const std::shared_ptr<Event>& event) override;
  void synchronize(StreamKind stream) override;

  size_t device_used_bytes() const { return device_limited_.used_bytes(); }

 private:
  SerialExecutor& worker(StreamKind stream);
  int64_t next_delay_us();

  SimConfig config_;
  HostMemoryResource device_host_;
  LimitingAdaptor device_limited_;
  HostMemoryResource host_;
  std::mutex rng_mutex_;
  std::mt19937_64 rng_;
  SerialExecutor h2d_;  // the copy streams: one thread each, copies in submission order
  SerialExecutor d2h_;
};

}  // namespace gx
