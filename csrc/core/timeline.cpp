#include "core/timeline.h"

#include <algorithm>

#include "core/errors.h"

namespace gx {

Timeline::Timeline(size_t capacity) : capacity_(capacity) {
  GX_CHECK(capacity > 0, "Timeline capacity: expected > 0 events, got 0.");
}

void Timeline::note(char kind, ChunkId chunk, int64_t device_bytes) {
  const TimelineEvent e{std::chrono::duration<double>(std::chrono::steady_clock::now() - created_).count(), kind,
                        chunk, device_bytes};
  if (kind == 'S') {
    last_iteration_peak_bytes_ = iteration_peak_bytes_;
    iteration_peak_bytes_ = 0;
  } else {
    iteration_peak_bytes_ = std::max(iteration_peak_bytes_, device_bytes);
  }
  if (events_.size() < capacity_) {
    events_.push_back(e);
  } else {
    events_[next_] = e;
    next_ = (next_ + 1) % capacity_;
  }
}

std::vector<TimelineEvent> Timeline::events() const {
  std::vector<TimelineEvent> out(events_.begin() + static_cast<std::ptrdiff_t>(next_), events_.end());
  out.insert(out.end(), events_.begin(), events_.begin() + static_cast<std::ptrdiff_t>(next_));
  return out;
}

}  // namespace gx
