// ManualEvent: an Event whose completion a test sets by hand, counting the waits on it (tests of
// stream-ordered reuse: FixedSizePool, ChunkAllocator, SizeClassPool).
#pragma once

#include "core/device_backend.h"

namespace gx::testing {

class ManualEvent final : public Event {
 public:
  bool query() const override { return done; }
  void synchronize() override {
    waits += 1;
    done = true;
  }
  double seconds_after(const Event&) const override { return 0.0; }
  bool done = false;
  int waits = 0;
};

}  // namespace gx::testing
