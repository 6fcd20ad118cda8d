// OptimizerPipeline: chunk sets' CPU optimizer steps on a background thread, settled one by one.
//
// Design note. A host set's step is launched as two parts: `compute` runs on the executor's
// thread (raw host memory only, never the manager's books), `complete` runs on the thread that
// settles the set (under its owner's lock: it makes P's other copy coherent). Until settled the
// set is pending: its owner settles it before anything touches its chunks. Settling waits for
// the compute part when it still runs (counted in wait_seconds / waits) and rethrows what it
// threw as an InternalError naming the set. `eager` says whether a finished step may be settled
// before anyone needs it (settle_finished, which prefetch calls); a speculative step may not
// until it was confirmed. The priority of a launch is the set's position in the next forward
// (SerialExecutor takes the most urgent first). With overlap off, launch settles the step before
// it returns (the serial step, for comparison). Tests may hold the thread (steps wait before
// they start) or slow each task down. Not thread-safe itself: its owner calls it under its lock.
// Lanes. A step runs on one of two threads: kCpu, where the CPU kernels run, or kLink, where
// a set's step is the device's kernel over the host memory (launched, then waited for), so
// that the two proceed at once on different sets. Settling is the same for both.
// Ranges. Each step runs under a range named for its lane, its kind (`what`: "step", "guess",
// "spare step", "correction") and its set, and a settle or wait that waits for a running step under
// "gx.wait set N" (TraceRanges: a profiler's timeline).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/serial_executor.h"
#include "core/trace_ranges.h"

namespace gx {

enum class StepLane : int { kCpu = 0, kLink = 1 };

class OptimizerPipeline {
 public:
  // `on_settled(set)` runs after a set's `complete`; `describe(set)` names a set in errors.
  OptimizerPipeline(std::function<void(int)> on_settled, std::function<std::string(int)> describe);
  ~OptimizerPipeline();  // lets every launched step finish
  OptimizerPipeline(const OptimizerPipeline&) = delete;
  OptimizerPipeline& operator=(const OptimizerPipeline&) = delete;

  void launch(int set, std::function<void()> compute, std::function<void()> complete, std::function<bool()> eager,
              int64_t priority, StepLane lane = StepLane::kCpu, const char* what = "step");
  void settle(int set);      // no-op when the set is not pending
  bool try_settle(int set);  // settles a finished step; false while it runs
  void wait(int set);        // waits for the set's compute part, leaving it pending (no-op when not pending)
  void settle_all();         // in launch order
  void settle_finished();    // the eager steps that finished
  void drain();              // waits for every compute part (nothing is settled)
  void set_overlap(bool overlap) { overlap_ = overlap; }  // off: every launch settles at once
  void set_trace_ranges(TraceRanges& ranges) { ranges_ = &ranges; }  // must outlive the pipeline

  bool pending(int set) const { return pending_.count(set) != 0; }
  size_t pending_count() const { return pending_.size(); }
  const std::deque<int>& pending_sets() const { return order_; }  // launch order

  // compute time of the settled steps, per lane (kLink: from launch to the kernels' end)
  double host_step_seconds(StepLane lane = StepLane::kCpu) const { return step_seconds_[static_cast<int>(lane)]; }
  void reset_host_step_seconds() { step_seconds_[0] = step_seconds_[1] = 0.0; }
  double wait_seconds() const { return wait_seconds_; }  // time settling waited for a running step
  int64_t waits() const { return waits_; }

  void hold(bool hold);                   // tests: steps wait before they start while held
  void set_task_delay_us(int64_t delay);  // tests: every step takes this much longer (its seconds count it)

 private:
  struct Pending {
    std::shared_future<void> done;
    std::function<void()> complete;
    std::shared_ptr<double> seconds;  // written by the task
    std::function<bool()> eager;
    StepLane lane = StepLane::kCpu;
  };
  void wait_for(std::shared_future<void>& done, int set);  // counted, under a range
  struct Gate {
    std::mutex mutex;
    std::condition_variable opened;
    bool held = false;
    int64_t delay_us = 0;
  };

  std::function<void(int)> on_settled_;
  std::function<std::string(int)> describe_;
  std::map<int, Pending> pending_;  // by set index
  std::deque<int> order_;           // launch order
  double step_seconds_[2] = {0.0, 0.0};
  double wait_seconds_ = 0.0;
  int64_t waits_ = 0;
  bool overlap_ = true;
  TraceRanges* ranges_ = &TraceRanges::none();
  std::shared_ptr<Gate> gate_ = std::make_shared<Gate>();
  std::unique_ptr<SerialExecutor> workers_[2];  // per lane; last: joined first
};

}  // namespace gx
