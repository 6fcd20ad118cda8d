// ArenaResource: a tier's reserved arena, carved into blocks for the chunk pools above it.
//
// Design note. Chunk slots are few and large (tens of MB), so the arena keeps a sorted map of
// free ranges per extent and serves first-fit, coalescing neighbours on free; no size classes.
// An extent is one upstream allocation: `reserve(bytes)` takes one up front (the reserved
// arena: one cudaMalloc for all chunk slots that fit, so chunk memory does not interleave with
// anything else), and a request that no free range holds takes a growth extent of exactly the
// request (unrounded, so byte limits see what the chunk needs) from the upstream, so that memory taken beyond the
// reservation can be given back one extent at a time. `trim()` returns every wholly free extent (the reservation
// included) to the upstream; the process-wide allocator mode trims after evicting chunks so that their memory serves
// other allocations. Blocks start aligned to kResourceAlignmentBytes: a block carved from a larger range takes its
// rounded size; one that fits a range only unrounded takes the whole range. Statistics: `in_use` (blocks handed out),
// `reserved` (extents owned), both Stat. Deallocating an unknown pointer or a size that differs from the allocation is
// a bug.
#pragma once

#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

#include "memory_resource.h"
#include "stat.h"

namespace gx {

class ArenaResource final : public MemoryResource {
 public:
  explicit ArenaResource(MemoryResource& upstream) : upstream_(upstream) {}
  ~ArenaResource() override;

  std::string name() const override { return upstream_.name() + "_arena"; }
  void reserve(size_t bytes);  // one extent of at least `bytes` (rounded up to the alignment)
  size_t trim();               // gives wholly free extents back; returns the bytes released

  Stat in_use_bytes() const;
  Stat reserved_bytes() const;
  size_t extents() const;
  size_t largest_free_block() const;

 protected:
  void* do_allocate(size_t bytes) override;
  void do_deallocate(void* ptr, size_t bytes) override;

 private:
  struct Extent {
    size_t bytes = 0;
    size_t used_bytes = 0;
    std::map<uintptr_t, size_t> free;  // start address -> length, non-adjacent (coalesced)
  };
  void* carve(Extent& e, std::map<uintptr_t, size_t>::iterator range, size_t bytes);
  Extent& extent_of(uintptr_t address);

  MemoryResource& upstream_;
  mutable std::mutex mutex_;
  std::map<uintptr_t, Extent> extents_;            // base address -> extent
  std::unordered_map<uintptr_t, size_t> blocks_;   // live block -> bytes (rounded)
  Stat in_use_;
  Stat reserved_;
};

}  // namespace gx
