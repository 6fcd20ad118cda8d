// ThreadPool: persistent host worker threads for CPU kernels (CPU Adam and, later, the offload
// pipeline's per-chunk steps).
//
// Design note. parallel_for(n, grain, fn) splits [0, n) into contiguous pieces of at least `grain`
// items, up to kPiecesPerThread per thread, and the workers and the calling thread each take the
// next untaken piece until none is left (a shared atomic counter): a thread that the OS preempts
// (the training loop's own thread, CUDA's driver threads and the copy threads share these cores
// while backward runs) delays only the piece it holds, instead of a fixed 1/size() share that
// everyone else would wait for. Pieces are contiguous and large (a grain is ~1.8 MB of CPU Adam
// traffic) so that each thread still streams through memory. An exception thrown by a piece is
// rethrown to the caller after every piece finished. The pool size is GEMINI_EXT_CPU_THREADS when
// set, else std::thread::hardware_concurrency(). One parallel_for runs at a time per pool (calls
// from several threads are serialised).
#pragma once

#include <atomic>
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
  static constexpr int64_t kPiecesPerThread = 8;

  // Runs untaken pieces of the current call until none is left; returns the first exception.
  std::exception_ptr run_pieces();

  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;                      // items of the current call
  int64_t piece_items_ = 0;            // items per piece (the last one may be shorter)
  int64_t pieces_ = 0;                 // pieces of the current call
  std::atomic<int64_t> next_piece_{0};  // the next untaken piece
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace gx
