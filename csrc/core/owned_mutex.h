// OwnedMutex: a mutex that knows which thread holds it.
//
// Design note. The process-wide allocator may call back into a manager (to evict chunks) from
// inside any CUDA allocation, including one made by the manager itself while it holds its
// mutex; locking again would deadlock and try_lock on a mutex the thread already holds is
// undefined. Such a callback asks `held_by_this_thread()` first and declines. Meets the
// Lockable requirements, so std::lock_guard / std::unique_lock work with it.
#pragma once

#include <atomic>
#include <mutex>
#include <thread>

namespace gx {

class OwnedMutex {
 public:
  void lock() {
    mutex_.lock();
    owner_.store(std::this_thread::get_id(), std::memory_order_release);
  }
  bool try_lock() {
    if (!mutex_.try_lock()) return false;
    owner_.store(std::this_thread::get_id(), std::memory_order_release);
    return true;
  }
  void unlock() {
    owner_.store(std::thread::id(), std::memory_order_release);
    mutex_.unlock();
  }
  bool held_by_this_thread() const { return owner_.load(std::memory_order_acquire) == std::this_thread::get_id(); }

 private:
  std::mutex mutex_;
  std::atomic<std::thread::id> owner_{};
};

}  // namespace gx
