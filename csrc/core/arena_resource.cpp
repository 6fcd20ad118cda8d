#include "arena_resource.h"

#include "errors.h"
#include "types.h"

namespace gx {

ArenaResource::~ArenaResource() {
  for (auto& [base, e] : extents_) upstream_.deallocate(reinterpret_cast<void*>(base), e.bytes);
}

void ArenaResource::reserve(size_t bytes) {
  GX_CHECK(bytes > 0, "ArenaResource::reserve: expected a positive byte count, got 0.");
  const size_t rounded = round_up(bytes, kResourceAlignmentBytes);
  std::lock_guard<std::mutex> lock(mutex_);
  void* p = upstream_.allocate(rounded);  // OutOfMemoryError: nothing changed
  const auto base = reinterpret_cast<uintptr_t>(p);
  Extent& e = extents_[base];
  e.bytes = rounded;
  e.free.emplace(base, rounded);
  reserved_.increase(static_cast<int64_t>(rounded));
}

size_t ArenaResource::trim() {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t released = 0;
  for (auto it = extents_.begin(); it != extents_.end();) {
    if (it->second.used_bytes != 0) {
      ++it;
      continue;
    }
    upstream_.deallocate(reinterpret_cast<void*>(it->first), it->second.bytes);
    reserved_.decrease(static_cast<int64_t>(it->second.bytes));
    released += it->second.bytes;
    it = extents_.erase(it);
  }
  return released;
}

Stat ArenaResource::in_use_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_use_;
}

Stat ArenaResource::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reserved_;
}

size_t ArenaResource::extents() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return extents_.size();
}

size_t ArenaResource::largest_free_block() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t largest = 0;
  for (const auto& [base, e] : extents_)
    for (const auto& [start, len] : e.free) largest = len > largest ? len : largest;
  return largest;
}

void* ArenaResource::carve(Extent& e, std::map<uintptr_t, size_t>::iterator range, size_t bytes) {
  const uintptr_t start = range->first;
  const size_t len = range->second;
  e.free.erase(range);
  if (len > bytes) e.free.emplace(start + bytes, len - bytes);
  e.used_bytes += bytes;
  blocks_.emplace(start, bytes);
  in_use_.increase(static_cast<int64_t>(bytes));
  return reinterpret_cast<void*>(start);
}

void* ArenaResource::do_allocate(size_t bytes) {
  GX_CHECK(bytes > 0, "ArenaResource ", name(), ": allocation of 0 bytes.");
  const size_t rounded = round_up(bytes, kResourceAlignmentBytes);  // what a block carved from a larger range takes
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [base, e] : extents_) {  // first fit, lowest address first
    for (auto it = e.free.begin(); it != e.free.end(); ++it) {
      if (it->second >= rounded) return carve(e, it, rounded);
      // A range that holds the request but not its rounded size is taken whole: nothing is
      // left after it whose start would be misaligned.
      if (it->second >= bytes) return carve(e, it, it->second);
    }
  }
  // A growth extent of exactly the request (no rounding: byte limits such as the sim
  // device's capacity see what the chunk needs), taken whole by the block.
  void* p = upstream_.allocate(bytes);
  const auto base = reinterpret_cast<uintptr_t>(p);
  Extent& e = extents_[base];
  e.bytes = bytes;
  reserved_.increase(static_cast<int64_t>(bytes));
  e.free.emplace(base, bytes);
  return carve(e, e.free.begin(), bytes);
}

ArenaResource::Extent& ArenaResource::extent_of(uintptr_t address) {
  auto it = extents_.upper_bound(address);
  GX_INTERNAL_ASSERT(it != extents_.begin(), "ArenaResource: address outside every extent");
  --it;
  GX_INTERNAL_ASSERT(address < it->first + it->second.bytes, "ArenaResource: address outside every extent");
  return it->second;
}

void ArenaResource::do_deallocate(void* ptr, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto start = reinterpret_cast<uintptr_t>(ptr);
  auto block = blocks_.find(start);
  GX_INTERNAL_ASSERT(block != blocks_.end(), "ArenaResource ", name(),
                     ": deallocate of a pointer that is not a live block (double free?)");
  const size_t rounded = block->second;
  GX_INTERNAL_ASSERT(bytes <= rounded && rounded - bytes < kResourceAlignmentBytes, "ArenaResource ", name(),
                     ": deallocate of ", bytes, " bytes for a block of ", rounded);
  blocks_.erase(block);
  Extent& e = extent_of(start);
  e.used_bytes -= rounded;
  in_use_.decrease(static_cast<int64_t>(rounded));
  // Insert the range and coalesce with the free neighbours on both sides.
  uintptr_t new_start = start;
  size_t new_len = rounded;
  auto next = e.free.lower_bound(start);
  if (next != e.free.end() && next->first == start + rounded) {
    new_len += next->second;
    next = e.free.erase(next);
  }
  if (next != e.free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      new_start = prev->first;
      new_len += prev->second;
      e.free.erase(prev);
    }
  }
  e.free.emplace(new_start, new_len);
}

}  // namespace gx
