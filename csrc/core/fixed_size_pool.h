// FixedSizePool: a resource handing out slots of one fixed size, reused, over an upstream.
//
// Design note. Chunks of a group all have the same byte size, so their copies on a tier can
// live in interchangeable slots. The pool takes slots from its upstream only when no free
// slot is left, keeps released slots on a free list and hands them out again (most recently
// released first, which is the warmest in caches), so moving chunks back and forth never
// fragments the tier and costs no upstream call after warm-up. `reserve(n)` takes n slots up
// front; `release_free_slots()` gives the unused ones back. Statistics:
//   in_use_bytes: slots handed out (Stat),  reserved_bytes: slots owned, free or not.
// A deallocate of a pointer the pool did not hand out, or of a slot already free, is a bug
// and throws InternalError. A request larger than the slot size is a caller's mistake.
#pragma once

#include <mutex>
#include <unordered_set>
#include <vector>

#include "memory_resource.h"
#include "stat.h"

namespace gx {

class FixedSizePool final : public MemoryResource {
 public:
  FixedSizePool(MemoryResource& upstream, size_t slot_bytes);
  ~FixedSizePool() override;

  std::string name() const override;
  size_t slot_bytes() const { return slot_bytes_; }
  void reserve(size_t slots);
  void release_free_slots();

  Stat in_use_bytes() const;
  size_t reserved_bytes() const;
  size_t free_slots() const;
  size_t upstream_allocations() const;  // how many times the upstream was asked (reuse metric)

 protected:
  void* do_allocate(size_t bytes) override;
  void do_deallocate(void* ptr, size_t bytes) override;

 private:
  MemoryResource& upstream_;
  size_t slot_bytes_;
  mutable std::mutex mutex_;
  std::vector<void*> free_;
  std::unordered_set<void*> owned_;
  std::unordered_set<void*> handed_out_;
  Stat in_use_;
  size_t upstream_allocations_ = 0;
};

}  // namespace gx
