// PeakWindow: the high watermark of a byte count since a window began, kept beside (never in
// place of) the owner's own peak statistic.
//
// Design note. The auto policy needs the peak of non-model memory per iteration. Resetting the
// allocator's peak statistic to measure it would clobber a figure the user reads
// (torch.cuda.max_memory_allocated(), gx.memory_stats()), so the engine follows the allocation
// stream itself: `add` is called with every allocation (+bytes) and free (-bytes), `begin`
// starts a window at the count as it is now, `peak` is the largest count seen since. Lock-free:
// `add` runs inside allocators, under their locks, on any thread.
#pragma once

#include <atomic>
#include <cstdint>

namespace gx {

class PeakWindow {
 public:
  void begin(int64_t current_bytes) {
    current_.store(current_bytes, std::memory_order_relaxed);
    peak_.store(current_bytes, std::memory_order_relaxed);
  }
  void add(int64_t delta_bytes) {
    const int64_t now = current_.fetch_add(delta_bytes, std::memory_order_relaxed) + delta_bytes;
    int64_t seen = peak_.load(std::memory_order_relaxed);
    while (now > seen && !peak_.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }
  int64_t current() const { return current_.load(std::memory_order_relaxed); }
  int64_t peak() const { return peak_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
};

}  // namespace gx
