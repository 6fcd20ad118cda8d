#include "chunk_allocator.h"

#include "errors.h"

namespace gx {

ChunkAllocator::ChunkAllocator(std::array<MemoryResource*, kNumTiers> upstreams) : upstreams_(upstreams) {
  for (int t = 0; t < kNumTiers; ++t) {
    if (upstreams[t] != nullptr) upstreams_stats_[t] = std::make_unique<StatisticsAdaptor>(*upstreams[t]);
  }
}

FixedSizePool& ChunkAllocator::pool(Tier tier, size_t slot_bytes) {
  const int t = static_cast<int>(tier);
  GX_CHECK(upstreams_stats_[t] != nullptr, "tier ", to_string(tier),
           " is not available on this backend; choose another tier (e.g. pageable_host when pin_memory=False).");
  auto& by_size = pools_[t];
  auto it = by_size.find(slot_bytes);
  if (it == by_size.end()) {
    it = by_size.emplace(slot_bytes, std::make_unique<FixedSizePool>(*upstreams_stats_[t], slot_bytes)).first;
  }
  return *it->second;
}

void* ChunkAllocator::allocate(Tier tier, size_t slot_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  FixedSizePool& p = pool(tier, slot_bytes);
  void* ptr = nullptr;
  try {
    ptr = p.allocate(slot_bytes);
  } catch (const OutOfMemoryError&) {
    // Free slots cached by pools of other sizes on this tier count against the same limit:
    // give them back and try once more before the caller has to evict anything.
    for (auto& [size, other] : pools_[static_cast<int>(tier)]) other->release_free_slots();
    ptr = p.allocate(slot_bytes);
  }
  in_use_[static_cast<int>(tier)].increase(static_cast<int64_t>(slot_bytes));
  return ptr;
}

void ChunkAllocator::deallocate(Tier tier, void* ptr, size_t slot_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& by_size = pools_[static_cast<int>(tier)];
  auto it = by_size.find(slot_bytes);
  GX_INTERNAL_ASSERT(it != by_size.end(), "deallocate on tier ", to_string(tier), " of a ", slot_bytes,
                     "-byte slot with no pool of that size");
  it->second->deallocate(ptr, slot_bytes);
  in_use_[static_cast<int>(tier)].decrease(static_cast<int64_t>(slot_bytes));
}

void ChunkAllocator::reserve(Tier tier, size_t slot_bytes, size_t slots) {
  std::lock_guard<std::mutex> lock(mutex_);
  pool(tier, slot_bytes).reserve(slots);
}

void ChunkAllocator::release_free_slots() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& by_size : pools_)
    for (auto& [size, p] : by_size) p->release_free_slots();
}

Stat ChunkAllocator::in_use_bytes(Tier tier) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_use_[static_cast<int>(tier)];
}

Stat ChunkAllocator::reserved_bytes(Tier tier) const {
  const auto& s = upstreams_stats_[static_cast<int>(tier)];
  return s ? s->bytes() : Stat{};
}

size_t ChunkAllocator::upstream_allocations(Tier tier) const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t n = 0;
  for (const auto& [size, p] : pools_[static_cast<int>(tier)]) n += p->upstream_allocations();
  return n;
}

}  // namespace gx
