// ChunkAllocator: the chunk pool of every tier, one FixedSizePool per (tier, slot size).
//
// Design note. A group's chunks share one byte size, and a tensor larger than the chunk size
// brings one more size; so a handful of pools per tier serve all chunk copies. Each tier has an
// upstream (device memory of the backend, pinned or pageable host memory) wrapped in a
// StatisticsAdaptor, so `reserved` per tier is what the pools took from the system and `in_use`
// what chunks hold now. Pools are created on first use of a size and live until the allocator
// dies; `release_free_slots()` trims them. An allocation the upstream refuses first trims the
// tier's other pools and retries, so cached slots of one size never starve another size.
#pragma once

#include <array>
#include <map>
#include <memory>
#include <mutex>

#include "fixed_size_pool.h"
#include "resource_adaptors.h"
#include "types.h"

namespace gx {

class ChunkAllocator {
 public:
  // `upstreams[t]` serves tier t; a null upstream means the tier is unavailable.
  explicit ChunkAllocator(std::array<MemoryResource*, kNumTiers> upstreams);

  void* allocate(Tier tier, size_t slot_bytes);
  void deallocate(Tier tier, void* ptr, size_t slot_bytes);
  void reserve(Tier tier, size_t slot_bytes, size_t slots);
  void release_free_slots();

  bool has_tier(Tier tier) const { return upstreams_[static_cast<int>(tier)] != nullptr; }
  Stat in_use_bytes(Tier tier) const;   // slots handed out on the tier
  Stat reserved_bytes(Tier tier) const;  // bytes the tier's pools took from the upstream
  size_t upstream_allocations(Tier tier) const;

 private:
  FixedSizePool& pool(Tier tier, size_t slot_bytes);

  std::array<std::unique_ptr<StatisticsAdaptor>, kNumTiers> upstreams_stats_;
  std::array<MemoryResource*, kNumTiers> upstreams_{};
  std::array<std::map<size_t, std::unique_ptr<FixedSizePool>>, kNumTiers> pools_;
  std::array<Stat, kNumTiers> in_use_;  // exact per tier, updated only in allocate/deallocate
  mutable std::mutex mutex_;
};

}  // namespace gx
