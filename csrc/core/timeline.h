// Timeline: the scheduling events of one manager, for memory_timeline() and the MemoryTracer.
//
// Design note. Every fetch for compute ('F'), prefetch started ('P'), eviction ('E') and
// iteration end ('S') is recorded with the chunk bytes on the device right after it, in a ring
// of at most `capacity` events (the oldest are overwritten), so that a long run keeps a bounded
// history. Times are seconds since the timeline was created. The peak device bytes of the events
// between two iteration ends is kept apart (exact however many events the ring dropped). Not thread-safe: its owner
// (the manager) calls it under its own lock.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/types.h"

namespace gx {

struct TimelineEvent {
  double seconds = 0.0;  // since the timeline was created
  char kind = 'F';
  ChunkId chunk = -1;
  int64_t device_bytes = 0;  // chunk bytes on the device after the event
};

class Timeline {
 public:
  explicit Timeline(size_t capacity = size_t{1} << 16);
  void note(char kind, ChunkId chunk, int64_t device_bytes);
  std::vector<TimelineEvent> events() const;  // oldest first
  // The highest device_bytes among the events between the last two 'S' events (before the first
  // 'S': since creation), 'S' events themselves not counted; 0 when there were none.
  int64_t last_iteration_peak_bytes() const { return last_iteration_peak_bytes_; }

 private:
  size_t capacity_;
  std::vector<TimelineEvent> events_;
  size_t next_ = 0;  // ring position once full
  int64_t iteration_peak_bytes_ = 0;       // of the events since the last 'S'
  int64_t last_iteration_peak_bytes_ = 0;  // of the events between the last two 'S'
  std::chrono::steady_clock::time_point created_ = std::chrono::steady_clock::now();
};

}  // namespace gx
