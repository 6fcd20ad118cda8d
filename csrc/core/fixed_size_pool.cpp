#include "fixed_size_pool.h"

#include "errors.h"

namespace gx {

FixedSizePool::FixedSizePool(MemoryResource& upstream, size_t slot_bytes) : upstream_(upstream), slot_bytes_(slot_bytes) {
  GX_CHECK(slot_bytes > 0, "FixedSizePool slot_bytes: expected > 0, got 0.");
}

FixedSizePool::~FixedSizePool() {
  for (void* p : owned_) upstream_.deallocate(p, slot_bytes_);
}

std::string FixedSizePool::name() const { return upstream_.name() + "_pool"; }

void FixedSizePool::reserve(size_t slots) {
  std::lock_guard<std::mutex> lock(mutex_);
  while (free_.size() < slots) {
    void* p = upstream_.allocate(slot_bytes_);
    ++upstream_allocations_;
    owned_.insert(p);
    free_.push_back(p);
  }
}

void FixedSizePool::release_free_slots() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (void* p : free_) {
    owned_.erase(p);
    upstream_.deallocate(p, slot_bytes_);
  }
  free_.clear();
}

Stat FixedSizePool::in_use_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_use_;
}

size_t FixedSizePool::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return owned_.size() * slot_bytes_;
}

size_t FixedSizePool::free_slots() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return free_.size();
}

size_t FixedSizePool::upstream_allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return upstream_allocations_;
}

void* FixedSizePool::do_allocate(size_t bytes) {
  GX_CHECK(bytes > 0 && bytes <= slot_bytes_, "FixedSizePool ", name(), ": request of ", bytes,
           " bytes, expected 1..", slot_bytes_, " (the slot size). Use a pool whose slot fits the chunk.");
  std::lock_guard<std::mutex> lock(mutex_);
  void* p = nullptr;
  if (!free_.empty()) {
    p = free_.back();
    free_.pop_back();
  } else {
    p = upstream_.allocate(slot_bytes_);  // may throw OutOfMemoryError; nothing changed yet
    ++upstream_allocations_;
    owned_.insert(p);
  }
  handed_out_.insert(p);
  in_use_.increase(static_cast<int64_t>(slot_bytes_));
  return p;
}

void FixedSizePool::do_deallocate(void* ptr, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  GX_INTERNAL_ASSERT(bytes <= slot_bytes_, "deallocate of ", bytes, " bytes into a pool of ", slot_bytes_,
                     "-byte slots");
  GX_INTERNAL_ASSERT(handed_out_.erase(ptr) == 1, "FixedSizePool ", name(),
                     ": deallocate of a pointer that is not a live slot of this pool (double free?)");
  in_use_.decrease(static_cast<int64_t>(slot_bytes_));
  free_.push_back(ptr);
}

}  // namespace gx
