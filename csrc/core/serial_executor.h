// SerialExecutor: one background thread that runs submitted tasks one at a time, the most urgent
// first (lowest priority value; submission order among equals).
//
// Design note. The offload pipeline hands each chunk set's CPU optimizer step to this thread so
// that optimizer.step() returns while the host works, and the next forward waits only for the
// chunk it is about to use. The priority is the chunk's position in the next forward: steps
// started during backward arrive last layer first, but whenever the thread picks its next task
// it takes the one the forward needs soonest, so the first chunks are ready first. A task
// parallelises itself (CPU Adam splits its elements over the ThreadPool). submit() returns
// a shared_future: get() waits for that task and rethrows what it threw. A task's exception
// does not stop the ones after it. The destructor runs what is queued, then joins.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

namespace gx {

class SerialExecutor {
 public:
  SerialExecutor();
  ~SerialExecutor();
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  std::shared_future<void> submit(std::function<void()> task, int64_t priority = 0);
  void drain();                // returns once every task submitted so far has run
  size_t queued() const;       // submitted and not finished (the running one included)

 private:
  void loop();

  mutable std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable idle_cv_;
  struct Queued {
    int64_t priority;
    uint64_t seq;
    std::function<void()> task;
    std::promise<void> done;
  };
  std::deque<Queued> queue_;
  uint64_t next_seq_ = 0;
  size_t unfinished_ = 0;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members above exist
};

}  // namespace gx
