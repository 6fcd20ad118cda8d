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

std::shared_future<void> SerialExecutor::submit(std::function<void()> task) {
  std::packaged_task<void()> packaged(std::move(task));
  std::shared_future<void> done = packaged.get_future().share();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(packaged));
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
    std::packaged_task<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();  // an exception is stored in the task's future
    {
      std::lock_guard<std::mutex> lock(mutex_);
      unfinished_ -= 1;
    }
    idle_cv_.notify_all();
  }
}

}  // namespace gx
