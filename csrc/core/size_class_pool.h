// SizeClassPool: a resource for requests of many sizes that repeat (offloaded activations), each
// rounded up to a size class and served from that class's FixedSizePool over one upstream.
//
// Design note. Every training step offloads tensors of the same few sizes (a block's input, a
// shared table), so a pool per size makes the second step allocate nothing. A class is the
// request rounded up to one of four steps between powers of two (at most 25% over the request,
// in steps of at least kResourceAlignmentBytes), so sizes that differ by a few bytes share slots. Reuse is
// stream-ordered exactly as in FixedSizePool: a buffer freed while queued copies may still read
// or write it is freed with their events (`deallocate_after`), and `allocate_ordered` hands back
// a ready slot or the most recently freed one with the events the caller orders its first use
// after; the host never waits for a copy to reuse a buffer. `release_free` gives every free slot
// back (after its events), so a finished run holds no host memory for activations.
// Statistics: in_use_bytes (Stat, class bytes handed out) and reserved_bytes (owned, free or
// not), summed over the classes. Thread-safe: buffers are freed from autograd's threads.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "fixed_size_pool.h"

namespace gx {

class SizeClassPool final : public MemoryResource {
 public:
  explicit SizeClassPool(MemoryResource& upstream) : upstream_(upstream) {}
  std::string name() const override { return upstream_.name() + "_size_classes"; }

  // The slot size a request of `bytes` (> 0) is served from.
  static size_t class_bytes(size_t bytes);

  FixedSizePool::Ordered allocate_ordered(size_t bytes);
  void deallocate_after(void* ptr, size_t bytes, std::vector<std::shared_ptr<Event>> last_uses);
  // Whether a request of `bytes` would be served by a slot already owned (no upstream call).
  bool has_free_slot(size_t bytes) const;
  void release_free();

  Stat in_use_bytes() const;
  size_t reserved_bytes() const;
  size_t upstream_allocations() const;
  size_t ordered_reuses() const;

 protected:
  void* do_allocate(size_t bytes) override;
  void do_deallocate(void* ptr, size_t bytes) override;

 private:
  FixedSizePool& pool_for(size_t bytes);
  size_t sum_over_classes(size_t (FixedSizePool::*figure)() const) const;  // one figure, summed over the classes

  MemoryResource& upstream_;
  mutable std::mutex mutex_;  // guards the map; each pool guards itself
  std::map<size_t, std::unique_ptr<FixedSizePool>> pools_;
  Stat in_use_;
};

}  // namespace gx
