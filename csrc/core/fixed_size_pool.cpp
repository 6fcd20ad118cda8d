#include "fixed_size_pool.h"

#include <iterator>

#include "errors.h"

namespace gx {

FixedSizePool::FixedSizePool(MemoryResource& upstream, size_t slot_bytes)
    : upstream_(upstream), slot_bytes_(slot_bytes) {
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
    free_.push_back(FreeSlot{p, {}});
  }
}

bool FixedSizePool::FreeSlot::ready() const {
  for (const auto& e : last_uses)
    if (!e->query()) return false;
  return true;
}

void FixedSizePool::release_free_slots() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (FreeSlot& slot : free_) {
    for (const auto& e : slot.last_uses) e->synchronize();  // nothing queued touches it any more
    owned_.erase(slot.ptr);
    upstream_.deallocate(slot.ptr, slot_bytes_);
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

size_t FixedSizePool::reuse_waits() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reuse_waits_;
}

FixedSizePool::Ordered FixedSizePool::allocate_ordered(size_t bytes) {
  GX_CHECK(bytes > 0 && bytes <= slot_bytes_, "FixedSizePool ", name(), ": request of ", bytes,
           " bytes, expected 1..", slot_bytes_, " (the slot size). Use a pool whose slot fits the chunk.");
  std::lock_guard<std::mutex> lock(mutex_);
  Ordered out;
  for (auto it = free_.rbegin(); it != free_.rend(); ++it) {  // most recently freed first
    if (it->ready()) {
      out.ptr = it->ptr;
      free_.erase(std::next(it).base());
      break;
    }
  }
  if (out.ptr == nullptr && !free_.empty()) {  // every free slot is still used by queued work
    out.ptr = free_.back().ptr;
    out.wait_for = std::move(free_.back().last_uses);
    free_.pop_back();
    ++ordered_reuses_;
  }
  if (out.ptr == nullptr) {
    out.ptr = upstream_.allocate(slot_bytes_);  // may throw OutOfMemoryError; nothing changed yet
    ++upstream_allocations_;
    owned_.insert(out.ptr);
  }
  handed_out_.insert(out.ptr);
  in_use_.increase(static_cast<int64_t>(slot_bytes_));
  return out;
}

void* FixedSizePool::do_allocate(size_t bytes) {
  Ordered o = allocate_ordered(bytes);
  if (!o.wait_for.empty()) {
    for (const auto& e : o.wait_for) e->synchronize();
    std::lock_guard<std::mutex> lock(mutex_);
    ++reuse_waits_;
    --ordered_reuses_;
  }
  return o.ptr;
}

size_t FixedSizePool::ordered_reuses() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ordered_reuses_;
}

void FixedSizePool::do_deallocate(void* ptr, size_t bytes) { free_slot(ptr, bytes, {}); }

void FixedSizePool::deallocate_after(void* ptr, size_t bytes, std::vector<std::shared_ptr<Event>> last_uses) {
  free_slot(ptr, bytes, std::move(last_uses));
}

void FixedSizePool::free_slot(void* ptr, size_t bytes, std::vector<std::shared_ptr<Event>> last_uses) {
  std::lock_guard<std::mutex> lock(mutex_);
  GX_INTERNAL_ASSERT(bytes <= slot_bytes_, "deallocate of ", bytes, " bytes into a pool of ", slot_bytes_,
                     "-byte slots");
  GX_INTERNAL_ASSERT(handed_out_.erase(ptr) == 1, "FixedSizePool ", name(),
                     ": deallocate of a pointer that is not a live slot of this pool (double free?)");
  in_use_.decrease(static_cast<int64_t>(slot_bytes_));
  free_.push_back(FreeSlot{ptr, std::move(last_uses)});
}

}  // namespace gx
