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
//
// Stream-safe reuse. A slot freed while queued device work may still read or write it is
// freed with the events of its last uses (`deallocate_after`). `allocate_ordered` hands out a
// free slot whose events have all completed if there is one, else the most recently freed
// slot together with its pending events, which the caller orders its first use after (a
// stream wait, as stream-ordered allocators do): the pool never grows because a slot is busy,
// and never blocks the host. Only plain `allocate` (the MemoryResource interface, which returns
// a slot ready for any use) waits on pending events itself (counted in `reuse_waits`).
// `release_free_slots` waits for a slot's events before giving it back.
#pragma once

#include <memory>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "device_backend.h"
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
  struct Ordered {
    void* ptr = nullptr;
    std::vector<std::shared_ptr<Event>> wait_for;  // the first use must be ordered after these
  };
  Ordered allocate_ordered(size_t bytes);
  // Frees a slot that device work queued before the events may still use.
  void deallocate_after(void* ptr, size_t bytes, std::vector<std::shared_ptr<Event>> last_uses);

  Stat in_use_bytes() const;
  size_t reserved_bytes() const;
  size_t free_slots() const;
  size_t upstream_allocations() const;  // how many times the upstream was asked (reuse metric)
  size_t reuse_waits() const;           // plain allocations that blocked on a freed slot's last uses
  size_t ordered_reuses() const;        // slots handed out with pending events to order after

 protected:
  void* do_allocate(size_t bytes) override;
  void do_deallocate(void* ptr, size_t bytes) override;

 private:
  MemoryResource& upstream_;
  size_t slot_bytes_;
  mutable std::mutex mutex_;
  struct FreeSlot {
    void* ptr = nullptr;
    std::vector<std::shared_ptr<Event>> last_uses;  // all complete: the slot may be reused
    bool ready() const;
  };
  void free_slot(void* ptr, size_t bytes, std::vector<std::shared_ptr<Event>> last_uses);

  std::vector<FreeSlot> free_;
  std::unordered_set<void*> owned_;
  std::unordered_set<void*> handed_out_;
  Stat in_use_;
  size_t upstream_allocations_ = 0;
  size_t reuse_waits_ = 0;
  size_t ordered_reuses_ = 0;
};

}  // namespace gx
