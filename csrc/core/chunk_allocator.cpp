#include "chunk_allocator.h"

#include "errors.h"

namespace gx {

ChunkAllocator::ChunkAllocator(std::array<MemoryResource*, kNumTiers> upstreams) : upstreams_(upstreams) {
  for (int t = 0; t < kNumTiers; ++t) {
    if (upstreams[t] == nullptr) continue;
    upstreams_stats_[t] = std::make_unique<StatisticsAdaptor>(*upstreams[t]);
    arenas_[t] = std::make_unique<ArenaResource>(*upstreams_stats_[t]);
  }
}

FixedSizePool& ChunkAllocator::pool(Tier tier, size_t slot_bytes) {
  const int t = static_cast<int>(tier);
  GX_CHECK(upstreams_stats_[t] != nullptr, "tier ", to_string(tier),
           " is not available on this backend; choose another tier (e.g. pageable_host when pin_memory=False).");
  auto& by_size = pools_[t];
  auto it = by_size.find(slot_bytes);
  if (it == by_size.end()) {
    it = by_size.emplace(slot_bytes, std::make_unique<FixedSizePool>(*arenas_[t], slot_bytes)).first;
  }
  return *it->second;
}

FixedSizePool::Ordered ChunkAllocator::allocate_ordered(Tier tier, size_t slot_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  FixedSizePool& p = pool(tier, slot_bytes);
  FixedSizePool::Ordered out;
  try {
    out = p.allocate_ordered(slot_bytes);
  } catch (const OutOfMemoryError&) {
    // Free slots cached by pools of other sizes on this tier count against the same limit:
    // give them back to the arena and try once more before the caller has to evict anything.
    // (free ranges of the arena serve any size; wholly free extents go back to the upstream).
    for (auto& [size, other] : pools_[static_cast<int>(tier)]) other->release_free_slots();
    arenas_[static_cast<int>(tier)]->trim();
    out = p.allocate_ordered(slot_bytes);
  }
  in_use_[static_cast<int>(tier)].increase(static_cast<int64_t>(slot_bytes));
  return out;
}

void* ChunkAllocator::allocate(Tier tier, size_t slot_bytes) {
  FixedSizePool::Ordered o = allocate_ordered(tier, slot_bytes);
  for (const auto& e : o.wait_for) e->synchronize();
  return o.ptr;
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

void ChunkAllocator::deallocate_after(Tier tier, void* ptr, size_t slot_bytes,
                                      std::vector<std::shared_ptr<Event>> last_uses) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& by_size = pools_[static_cast<int>(tier)];
  auto it = by_size.find(slot_bytes);
  GX_INTERNAL_ASSERT(it != by_size.end(), "deallocate on tier ", to_string(tier), " of a ", slot_bytes,
                     "-byte slot with no pool of that size");
  it->second->deallocate_after(ptr, slot_bytes, std::move(last_uses));
  in_use_[static_cast<int>(tier)].decrease(static_cast<int64_t>(slot_bytes));
}

void ChunkAllocator::reserve_arena(Tier tier, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto& arena = arenas_[static_cast<int>(tier)];
  GX_CHECK(arena != nullptr, "tier ", to_string(tier), " is not available on this backend; nothing to reserve.");
  arena->reserve(bytes);
}

size_t ChunkAllocator::trim(Tier tier) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int t = static_cast<int>(tier);
  if (arenas_[t] == nullptr) return 0;
  for (auto& [size, p] : pools_[t]) p->release_free_slots();
  return arenas_[t]->trim();
}

size_t ChunkAllocator::reuse_waits(Tier tier) const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t n = 0;
  for (const auto& [size, p] : pools_[static_cast<int>(tier)]) n += p->reuse_waits();
  return n;
}

size_t ChunkAllocator::ordered_reuses(Tier tier) const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t n = 0;
  for (const auto& [size, p] : pools_[static_cast<int>(tier)]) n += p->ordered_reuses();
  return n;
}

size_t ChunkAllocator::arena_extents(Tier tier) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto& arena = arenas_[static_cast<int>(tier)];
  return arena ? arena->extents() : 0;
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
