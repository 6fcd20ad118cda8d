#include "thread_pool.h"

#include <algorithm>
#include <cstdlib>

#include "errors.h"

namespace gx {

ThreadPool::ThreadPool(int threads) {
  GX_CHECK(threads >= 1, "ThreadPool threads: expected >= 1, got ", threads, ".");
  for (int i = 0; i + 1 < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
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
    GX_CHECK(end != env && *end == '\0' && n >= 1 && n <= 4096,
             "GEMINI_EXT_CPU_THREADS: expected an integer in [1, 4096], got '", env, "'.");
    return static_cast<int>(n);
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool(default_threads());
  return pool;
}

void ThreadPool::worker_loop(int /*index*/) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    std::exception_ptr error = run_pieces();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (error && !error_) error_ = error;
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }
}

std::exception_ptr ThreadPool::run_pieces() {
  std::exception_ptr error;
  for (;;) {
    const int64_t piece = next_piece_.fetch_add(1, std::memory_order_relaxed);
    if (piece >= pieces_) return error;
    const int64_t begin = piece * piece_items_;
    try {
      (*fn_)(begin, std::min(n_, begin + piece_items_));
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t max_pieces = (n + grain - 1) / grain;
  if (max_pieces <= 1 || workers_.empty()) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t pieces = std::min<int64_t>(max_pieces, size() * kPiecesPerThread);
    fn_ = &fn;
    n_ = n;
    piece_items_ = (n + pieces - 1) / pieces;
    pieces_ = (n + piece_items_ - 1) / piece_items_;
    next_piece_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    pending_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  work_cv_.notify_all();
  std::exception_ptr caller_error = run_pieces();
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  fn_ = nullptr;
  if (caller_error) std::rethrow_exception(caller_error);
  if (error_) std::rethrow_exception(error_);
}

}  // namespace gx
