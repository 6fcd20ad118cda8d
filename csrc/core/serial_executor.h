// SerialExecutor: one background thread that runs submitted tasks in submission order.
//
// Design note. The offload pipeline hands each chunk set's CPU optimizer step to this thread so
// that optimizer.step() returns while the host works, and the next forward waits only for the
// chunk it is about to use. Tasks run one at a time and in the order they were submitted (the
// forward order of their chunks), so the first chunk the next forward needs is ready first; a
// task parallelises itself (CPU Adam splits its elements over the ThreadPool). submit() returns
// a shared_future: get() waits for that task and rethrows what it threw. A task's exception
// does not stop the ones after it. The destructor runs what is queued, then joins.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
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

  std::shared_future<void> submit(std::function<void()> task);
  void drain();                // returns once every task submitted so far has run
  size_t queued() const;       // submitted and not finished (the running one included)

 private:
  void loop();

  mutable std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable idle_cv_;
  std::deque<std::packaged_task<void()>> queue_;
  size_t unfinished_ = 0;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members above exist
};

}  // namespace gx
