// ChunkAllocator: the chunk pool of every tier, one FixedSizePool per (tier, slot size).
//
// Design note. A group's chunks share one byte size, and a tensor larger than the chunk size
// brings one more size; so a handful of pools per tier serve all chunk copies. Each tier has an
// upstream (device memory of the backend, pinned or pageable host memory) wrapped in a
// StatisticsAdaptor and an ArenaResource: `reserve_arena` takes the tier's reserved arena in
// one upstream allocation, the pools carve their slots from it (growing by exact extents when
// it is full), so `reserved` per tier is what the tier took from the system and `in_use` what
// chunks hold now. Slots freed with the events of their last uses are reused only once those
// completed (FixedSizePool); `trim(tier)` gives free slots and wholly free extents back. Pools are created on first use
// of a size and live until the allocator dies; `release_free_slots()` trims them. An allocation the upstream refuses
// first trims the tier's other pools and retries, so cached slots of one size never starve another size.
#pragma once

#include <array>
#include <map>
#include <memory>
#include <mutex>

#include "arena_resource.h"
#include "fixed_size_pool.h"
#include "resource_adaptors.h"
#include "types.h"

namespace gx {

class ChunkAllocator {
 public:
  // `upstreams[t]` serves tier t; a null upstream means the tier is unavailable.
  explicit ChunkAllocator(std::array<MemoryResource*, kNumTiers> upstreams);

  void* allocate(Tier tier, size_t slot_bytes);  // a slot ready for any use (waits if it must)
  // A slot whose first use must be ordered after `wait_for` (stream-safe reuse, never blocks).
  FixedSizePool::Ordered allocate_ordered(Tier tier, size_t slot_bytes);
  void deallocate(Tier tier, void* ptr, size_t slot_bytes);
  // Frees a slot that work queued before `last_uses` may still touch (stream-safe reuse).
  void deallocate_after(Tier tier, void* ptr, size_t slot_bytes, std::vector<std::shared_ptr<Event>> last_uses);
  void reserve(Tier tier, size_t slot_bytes, size_t slots);
  void reserve_arena(Tier tier, size_t bytes);  // the tier's reserved arena, one upstream allocation
  void release_free_slots();
  size_t trim(Tier tier);  // free slots and wholly free extents back to the upstream; bytes released

  bool has_tier(Tier tier) const { return upstreams_[static_cast<int>(tier)] != nullptr; }
  Stat in_use_bytes(Tier tier) const;   // slots handed out on the tier
  Stat reserved_bytes(Tier tier) const;  // bytes the tier's pools took from the upstream
  size_t upstream_allocations(Tier tier) const;  // slots the pools took from the arena
  size_t reuse_waits(Tier tier) const;
  size_t ordered_reuses(Tier tier) const;
  size_t arena_extents(Tier tier) const;

 private:
  FixedSizePool& pool(Tier tier, size_t slot_bytes);

  std::array<std::unique_ptr<StatisticsAdaptor>, kNumTiers> upstreams_stats_;
  std::array<std::unique_ptr<ArenaResource>, kNumTiers> arenas_;  // over upstreams_stats_
  std::array<MemoryResource*, kNumTiers> upstreams_{};
  std::array<std::map<size_t, std::unique_ptr<FixedSizePool>>, kNumTiers> pools_;
  std::array<Stat, kNumTiers> in_use_;  // exact per tier, updated only in allocate/deallocate
  mutable std::mutex mutex_;
};

}  // namespace gx
