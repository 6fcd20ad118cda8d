// MemoryPressure: the process-wide channel from an allocation that failed to whoever can free
// device memory.
//
// Design note. Under GEMINI_EXT_ALLOCATOR=chunk every CUDA allocation of the process goes
// through our allocator (csrc/cuda/process_allocator.*). When one would fail it asks the
// registered reclaimers of that device (each GeminiManager registers one: evict chunks that no
// tensor computes on, give their slots back) for the missing bytes, then retries. Conversely,
// when a chunk slot cannot be allocated, the cache releaser (the process allocator's cached
// free blocks) gives memory back first. The registry only routes: it decides nothing and owns
// no memory. Reclaimers run in registration order until enough was freed; a reclaimer must be
// safe to call from any allocation (it declines when its owner is busy on this thread).
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <mutex>

namespace gx {

class MemoryPressure {
 public:
  using Reclaimer = std::function<size_t(size_t bytes)>;  // frees device bytes; returns how many

  static MemoryPressure& instance();

  int add_reclaimer(int device, Reclaimer reclaimer);  // returns an id for remove_reclaimer
  void remove_reclaimer(int id);
  size_t reclaim(int device, size_t bytes);  // asks the device's reclaimers; total bytes freed
  size_t reclaimers(int device) const;

  void set_cache_releaser(std::function<size_t(int device)> releaser);  // empty function: none
  size_t release_caches(int device);  // bytes the cache gave back (0 without a releaser)

 private:
  struct Entry {
    int device;
    Reclaimer fn;
  };
  mutable std::mutex mutex_;
  std::map<int, Entry> reclaimers_;
  int next_id_ = 0;
  std::function<size_t(int)> cache_releaser_;
};

}  // namespace gx
