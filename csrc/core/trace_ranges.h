// TraceRanges: named ranges of what the engine does, for a profiler the core does not know.
//
// Design note. The core moves chunks and waits for them on the caller's thread, and runs host
// steps on its lanes' own threads. A timeline of those belongs to a profiler (torch.profiler:
// csrc/torch/profiler_ranges.cpp). `open(name)` opens a range on the calling thread, closed when
// the returned handle is released. `traced(name, work)` is called on the launching thread and
// returns the work to run on another: its range opens there, recorded by the launcher's profiler
// (a worker thread has none of its own). `active()` says whether anything records now, so that the
// names are built only then. The base class records nothing; it is every component's default.
#pragma once

#include <functional>
#include <memory>
#include <string>

namespace gx {

class TraceRanges {
 public:
  virtual ~TraceRanges() = default;
  virtual bool active() const { return false; }
  virtual std::shared_ptr<void> open(const std::string& /*name*/) { return nullptr; }
  virtual std::function<void()> traced(const std::string& /*name*/, std::function<void()> work) { return work; }

  static TraceRanges& none();  // records nothing; outlives every component
};

}  // namespace gx
