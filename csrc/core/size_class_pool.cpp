#include "size_class_pool.h"

#include <algorithm>

#include "errors.h"

namespace gx {

size_t SizeClassPool::class_bytes(size_t bytes) {
  GX_CHECK(bytes > 0, "SizeClassPool: expected a request of > 0 bytes, got 0.");
  if (bytes <= kResourceAlignmentBytes) return kResourceAlignmentBytes;
  size_t power = kResourceAlignmentBytes;
  while (power * 2 < bytes) power *= 2;  // power < bytes <= 2 * power
  const size_t step = std::max(power / 4, kResourceAlignmentBytes);  // up to four classes per power of two
  return (bytes + step - 1) / step * step;
}

FixedSizePool& SizeClassPool::pool_for(size_t bytes) {
  const size_t slot = class_bytes(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  auto& pool = pools_[slot];
  if (!pool) pool = std::make_unique<FixedSizePool>(upstream_, slot);
  return *pool;
}

FixedSizePool::Ordered SizeClassPool::allocate_ordered(size_t bytes) {
  FixedSizePool& pool = pool_for(bytes);
  FixedSizePool::Ordered out = pool.allocate_ordered(bytes);  // may throw OutOfMemoryError: nothing counted
  std::lock_guard<std::mutex> lock(mutex_);
  in_use_.increase(static_cast<int64_t>(pool.slot_bytes()));
  return out;
}

void SizeClassPool::deallocate_after(void* ptr, size_t bytes, std::vector<std::shared_ptr<Event>> last_uses) {
  FixedSizePool& pool = pool_for(bytes);
  pool.deallocate_after(ptr, bytes, std::move(last_uses));
  std::lock_guard<std::mutex> lock(mutex_);
  in_use_.decrease(static_cast<int64_t>(pool.slot_bytes()));
}

void* SizeClassPool::do_allocate(size_t bytes) {
  FixedSizePool::Ordered o = allocate_ordered(bytes);
  for (const auto& e : o.wait_for) e->synchronize();  // the plain interface returns a slot ready for any use
  return o.ptr;
}

void SizeClassPool::do_deallocate(void* ptr, size_t bytes) { deallocate_after(ptr, bytes, {}); }

bool SizeClassPool::has_free_slot(size_t bytes) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = pools_.find(class_bytes(bytes));
  return it != pools_.end() && it->second->free_slots() > 0;
}

void SizeClassPool::release_free() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [slot, pool] : pools_) pool->release_free_slots();
}

Stat SizeClassPool::in_use_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_use_;
}

size_t SizeClassPool::sum_over_classes(size_t (FixedSizePool::*figure)() const) const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t total = 0;
  for (const auto& [slot, pool] : pools_) total += ((*pool).*figure)();
  return total;
}

size_t SizeClassPool::reserved_bytes() const { return sum_over_classes(&FixedSizePool::reserved_bytes); }
size_t SizeClassPool::upstream_allocations() const { return sum_over_classes(&FixedSizePool::upstream_allocations); }
size_t SizeClassPool::ordered_reuses() const { return sum_over_classes(&FixedSizePool::ordered_reuses); }

}  // namespace gx
