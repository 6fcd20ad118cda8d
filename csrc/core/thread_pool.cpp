#include "thread_pool.h"

#include <algorithm>
#include <cstdlib>

#include "errors.h"

namespace gx {

ThreadPool::ThreadPool(int threads) {
  GX_CHECK(threads >= 1, "ThreadPool threads: expected >= 1, got ", threads, ".");
  for (int i = 0; i + 1 < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
  ranges_.resize(workers_.size());
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

int ThreadPool::default_threads() {
  if (const char* env = std::getenv("GEMINI_EXT_CPU_THREADS"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    GX_CHECK(end != env && *end == '\0' && n >= 1 && n <= 4096, "GEMINI_EXT_CPU_THREADS: expected an integer in [1, 4096], got '",
             env, "'.");
    return static_cast<int>(n);
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool(default_threads());
  return pool;
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    std::pair<int64_t, int64_t> range;
    const std::function<void(int64_t, int64_t)>* fn = nullptr;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      range = ranges_[static_cast<size_t>(index)];
      fn = fn_;
    }
    std::exception_ptr error;
    if (range.first < range.second) {
      try {
        (*fn)(range.first, range.second);
      } catch (...) {
        error = std::current_exception();
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (error && !error_) error_ = error;
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t pieces = std::min<int64_t>(size(), (n + grain - 1) / grain);
  if (pieces <= 1 || workers_.empty()) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mutex_);
  const int64_t per = (n + pieces - 1) / pieces;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < workers_.size(); ++i) {
      const int64_t piece = static_cast<int64_t>(i) + 1;  // piece 0 is the caller's
      ranges_[i] = {std::min(n, piece * per), std::min(n, (piece + 1) * per)};
    }
    fn_ = &fn;
    error_ = nullptr;
    pending_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  work_cv_.notify_all();
  std::exception_ptr caller_error;
  try {
    fn(0, std::min(n, per));
  } catch (...) {
    caller_error = std::current_exception();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  fn_ = nullptr;
  if (caller_error) std::rethrow_exception(caller_error);
  if (error_) std::rethrow_exception(error_);
}

}  // namespace gx
