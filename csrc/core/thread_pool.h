// ThreadPool: persistent host worker threads for CPU kernels (CPU Adam and, later, the offload
// pipeline's per-chunk steps).
//
// Design note. parallel_for(n, grain, fn) splits [0, n) into at most `size()` contiguous ranges of
// at least `grain` items, runs them on the workers and the calling thread, and returns when all
// are done; an exception thrown by a range is rethrown to the caller after every range finished.
// Ranges are contiguous so that each thread streams through its own part of memory. The pool
// size is GEMINI_EXT_CPU_THREADS when set, else std::thread::hardware_concurrency(). One
// parallel_for runs at a time per pool (calls from several threads are serialised).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace gx {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }  // workers + the caller
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

  // The process-wide pool for CPU kernels.
  static ThreadPool& global();
  static int default_threads();

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // one parallel_for at a time
  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  std::vector<std::pair<int64_t, int64_t>> ranges_;  // ranges_[i] for worker i
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace gx
