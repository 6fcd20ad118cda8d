#include "memory_pressure.h"

#include <vector>

#include "errors.h"

namespace gx {

MemoryPressure& MemoryPressure::instance() {
  static MemoryPressure* registry = new MemoryPressure();  // never destroyed: used until exit
  return *registry;
}

int MemoryPressure::add_reclaimer(int device, Reclaimer reclaimer) {
  GX_CHECK(static_cast<bool>(reclaimer), "MemoryPressure::add_reclaimer: expected a callable, got an empty one.");
  std::lock_guard<std::mutex> lock(mutex_);
  const int id = next_id_++;
  reclaimers_.emplace(id, Entry{device, std::move(reclaimer)});
  return id;
}

void MemoryPressure::remove_reclaimer(int id) {
  std::lock_guard<std::mutex> lock(mutex_);
  reclaimers_.erase(id);
}

size_t MemoryPressure::reclaim(int device, size_t bytes) {
  std::vector<Reclaimer> todo;
  {
    std::lock_guard<std::mutex> lock(mutex_);  // not held while reclaiming: reclaimers allocate
    for (const auto& [id, e] : reclaimers_)
      if (e.device == device) todo.push_back(e.fn);
  }
  size_t freed = 0;
  for (const auto& fn : todo) {
    if (freed >= bytes) break;
    freed += fn(bytes - freed);
  }
  return freed;
}

size_t MemoryPressure::reclaimers(int device) const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t n = 0;
  for (const auto& [id, e] : reclaimers_) n += e.device == device ? 1 : 0;
  return n;
}

void MemoryPressure::set_cache_releaser(std::function<size_t(int)> releaser) {
  std::lock_guard<std::mutex> lock(mutex_);
  cache_releaser_ = std::move(releaser);
}

size_t MemoryPressure::release_caches(int device) {
  std::function<size_t(int)> fn;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fn = cache_releaser_;
  }
  return fn ? fn(device) : 0;
}

}  // namespace gx
