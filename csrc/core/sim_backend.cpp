#include "sim_backend.h"

#include <chrono>
#include <cstring>

#include "errors.h"

namespace gx {

const char* to_string(StreamKind stream) {
  switch (stream) {
    case StreamKind::kCompute: return "compute";
    case StreamKind::kHostToDevice: return "h2d";
    case StreamKind::kDeviceToHost: return "d2h";
  }
  return "?";
}

bool SimEvent::query() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

void SimEvent::synchronize() {
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [this] { return done_; });
}

double SimEvent::seconds_after(const Event& earlier) const {
  const auto* other = dynamic_cast<const SimEvent*>(&earlier);
  GX_INTERNAL_ASSERT(other != nullptr, "seconds_after between events of different backends");
  GX_INTERNAL_ASSERT(query() && other->query(), "seconds_after on an event that is not complete");
  std::lock_guard<std::mutex> lock(mutex_);
  std::lock_guard<std::mutex> lock_other(other->mutex_);
  return std::chrono::duration<double>(done_at_ - other->done_at_).count();
}

void SimEvent::complete() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    done_at_ = std::chrono::steady_clock::now();
  }
  done_cv_.notify_all();
}

SimBackend::SimBackend(SimConfig config)
    : config_(config), device_limited_(device_host_, config.capacity_bytes, "sim_capacity"), rng_(config.seed) {
  GX_CHECK(config.capacity_bytes > 0, "sim_capacity: expected > 0 bytes, got 0. Give the sim device a capacity.");
  GX_CHECK(config.max_copy_delay_us >= 0, "sim max_copy_delay_us: expected >= 0, got ", config.max_copy_delay_us,
           ".");
}

SimBackend::~SimBackend() {
  h2d_.drain();
  d2h_.drain();
}

SerialExecutor& SimBackend::worker(StreamKind stream) {
  GX_INTERNAL_ASSERT(stream != StreamKind::kCompute, "the sim compute stream has no worker");
  return stream == StreamKind::kHostToDevice ? h2d_ : d2h_;
}

int64_t SimBackend::next_delay_us() {
  if (config_.max_copy_delay_us == 0) return 0;
  std::lock_guard<std::mutex> lock(rng_mutex_);
  return std::uniform_int_distribution<int64_t>(0, config_.max_copy_delay_us)(rng_);
}

void SimBackend::copy_async(void* dst, const void* src, size_t bytes, StreamKind stream) {
  if (stream == StreamKind::kCompute) {
    std::memcpy(dst, src, bytes);
    return;
  }
  const int64_t delay_us = next_delay_us();
  worker(stream).submit([dst, src, bytes, delay_us] {
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    std::memcpy(dst, src, bytes);
  });
}

void SimBackend::zero_async(void* dst, size_t bytes, StreamKind stream) {
  if (stream == StreamKind::kCompute) {
    std::memset(dst, 0, bytes);
    return;
  }
  worker(stream).submit([dst, bytes] { std::memset(dst, 0, bytes); });
}

std::shared_ptr<Event> SimBackend::record_event(StreamKind stream) {
  auto event = std::make_shared<SimEvent>();
  if (stream == StreamKind::kCompute) {
    event->complete();
  } else {
    worker(stream).submit([event] { event->complete(); });
  }
  return event;
}

void SimBackend::stream_wait_event(StreamKind stream, const std::shared_ptr<Event>& event) {
  GX_INTERNAL_ASSERT(event != nullptr, "stream_wait_event with a null event");
  if (stream == StreamKind::kCompute) {
    event->synchronize();
  } else {
    worker(stream).submit([event] { event->synchronize(); });
  }
}

void SimBackend::synchronize(StreamKind stream) {
  if (stream == StreamKind::kCompute) return;
  worker(stream).drain();
}

}  // namespace gx
