#include "serial_executor.h"

namespace gx {

SerialExecutor::SerialExecutor() : thread_([this] { loop(); }) {}

SerialExecutor::~SerialExecutor() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_cv_.notify_all();
  thread_.join();  // the loop leaves only with an empty queue
}

std::shared_future<void> SerialExecutor::submit(std::function<void()> task, int64_t priority) {
  std::promise<void> promise;
  std::shared_future<void> done = promise.get_future().share();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(Queued{priority, next_seq_++, std::move(task), std::move(promise)});
    unfinished_ += 1;
  }
  work_cv_.notify_one();
  return done;
}

void SerialExecutor::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_cv_.wait(lock, [this] { return unfinished_ == 0; });
}

size_t SerialExecutor::queued() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return unfinished_;
}

void SerialExecutor::loop() {
  for (;;) {
    std::function<void()> task;
    std::promise<void> promise;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to run
      auto next = queue_.begin();  // the most urgent: few tasks queue, a scan is enough
      for (auto it = queue_.begin(); it != queue_.end(); ++it)
        if (it->priority < next->priority || (it->priority == next->priority && it->seq < next->seq)) next = it;
      task = std::move(next->task);
      promise = std::move(next->done);
      queue_.erase(next);
    }
    std::exception_ptr thrown;
    try {
      task();
    } catch (...) {
      thrown = std::current_exception();
    }
    {
      // The count drops and the future becomes ready in one step: a caller that waited on the
      // future sees queued() without that task, and one that drained sees every future ready.
      std::lock_guard<std::mutex> lock(mutex_);
      unfinished_ -= 1;
      if (thrown)
        promise.set_exception(thrown);
      else
        promise.set_value();
    }
    idle_cv_.notify_all();
  }
}

}  // namespace gx
