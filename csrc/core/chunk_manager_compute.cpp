// ChunkManager, part 2: compute accesses and collectives. A compute access brings a chunk's shard
// to the device and, sharded, all-gathers it; release and ungather drop the gathered buffer;
// gathers started ahead (prefetch_gather) are waited for on the compute stream; reduce and
// reduce_scatter turn a gradient chunk's gathered buffer into this rank's reduced shard. See
// chunk_manager.h for the design.
#include <algorithm>
#include <cstring>

#include "chunk_manager.h"
#include "errors.h"

namespace gx {

void ChunkManager::access(ChunkId id) {
  check_finalized("access");
  Chunk& c = mutable_chunk(id);
  check_can_communicate("access", id);
  traffic_.accesses += 1;
  if (sharded() && c.gathered()) {
    if (prefetched_.erase(id) != 0) traffic_.prefetch_hits += 1;
    auto flying = gathers_in_flight_.find(id);
    if (flying != gathers_in_flight_.end()) {  // gathered ahead: compute waits for it on its stream
      compute_waits_for(flying->second);
      gathers_in_flight_.erase(flying);
    }
    return;  // gathered ahead, or kept gathered since an earlier access
  }
  bring_shard_to_device(c);
  if (!sharded()) {
    c.set_gathered_ptr(c.shard_ptr(Tier::kDevice));
    return;
  }
  add_gathered(c);
  // On the compute stream, after the shard's copy (compute already waits for it).
  communicator_->all_gather(c.shard_ptr(Tier::kDevice), c.gathered_ptr(), c.shard_numel(), c.dtype(),
                            StreamKind::kCompute);
  traffic_.all_gathers += 1;
}

void ChunkManager::bring_shard_to_device(Chunk& c) {
  const ChunkId id = c.id();
  auto flying = in_flight_.find(id);
  if (flying != in_flight_.end() && flying->second.to == Tier::kDevice && !flying->second.drop_source) {
    // A prefetch (or refresh) into the device copy: compute waits for it on its stream; the
    // record stays until poll() or an operation on the source reaps it.
    if (!flying->second.compute_waits) {
      compute_waits_for(flying->second.event);
      flying->second.compute_waits = true;
    }
    if (prefetched_.erase(id) != 0) traffic_.prefetch_hits += 1;
    return;
  }
  if (prefetched_.erase(id) != 0) traffic_.prefetch_hits += 1;
  if (!sharded() && c.gathered()) return;
  complete_move(id, /*block=*/true);  // an eviction finishes before we fetch back
  if (!c.shard_tiers().contains(Tier::kDevice)) {
    traffic_.fetches += 1;
    // Keep the host copy: it stays the chunk's home until a policy moves it.
    const Tier from = c.shard_tiers().contains(Tier::kPinnedHost) ? Tier::kPinnedHost : Tier::kPageableHost;
    GX_INTERNAL_ASSERT(c.shard_tiers().contains(from), "chunk ", id, " holds no data on any tier");
    add_copy(c, Tier::kDevice);
    std::shared_ptr<void> range = ranges_->active() ? ranges_->open(detail::concat("gx.fetch chunk ", id)) : nullptr;
    // Compute needs the chunk from here: the stall is measured from this point. The slot may
    // have been freed a moment ago while compute still read it: the copy starts after that.
    auto compute_reached = backend_.record_event(StreamKind::kCompute);
    backend_.stream_wait_event(StreamKind::kHostToDevice, compute_reached);
    backend_.copy_async(c.shard_ptr(Tier::kDevice), c.shard_ptr(from), c.shard_bytes(), StreamKind::kHostToDevice);
    count_traffic(from, Tier::kDevice, c.shard_bytes());
    compute_waits_for(backend_.record_event(StreamKind::kHostToDevice), compute_reached);
  }
}

void ChunkManager::release(ChunkId id, bool reshard) {
  check_finalized("release");
  Chunk& c = mutable_chunk(id);
  // Unsharded, releasing forgets the device view only: a chunk whose tensors wait for reduction
  // may be released too (its gradients live in another chunk). Sharded, the gathered buffer
  // stays until every gradient of the chunk is in.
  GX_INTERNAL_ASSERT(sharded() ? c.can_release()
                               : c.can_move() && c.count_in(TensorState::kFree) < static_cast<int64_t>(c.num_slots()),
                     "release of chunk ", id, " with ", c.count_in(TensorState::kCompute), " tensors in COMPUTE and ",
                     c.count_in(TensorState::kReadyForReduce), " READY_FOR_REDUCE");
  if (!sharded()) {
    c.set_gathered_ptr(nullptr);
  } else if (reshard && c.gathered()) {
    drop_gathered(c);
  }
}

void ChunkManager::ungather(ChunkId id) {
  check_finalized("ungather");
  Chunk& c = mutable_chunk(id);
  GX_CHECK(sharded(), "ungather of chunk ", id, ": the ChunkManager is not sharded; use release().");
  GX_INTERNAL_ASSERT(c.can_move(), "ungather of chunk ", id, " while ", c.count_in(TensorState::kCompute),
                     " of its tensors are in COMPUTE");
  if (c.gathered()) drop_gathered(c);
}

void ChunkManager::prefetch_gather(ChunkId id) {
  check_finalized("prefetch_gather");
  Chunk& c = mutable_chunk(id);
  GX_CHECK(sharded(), "prefetch_gather of chunk ", id, ": the ChunkManager is not sharded; use prefetch().");
  if (c.gathered()) return;
  complete_move(id, /*block=*/true);  // an eviction in flight finishes first
  const bool fetch = !c.shard_tiers().contains(Tier::kDevice);
  add_gathered(c);  // throws OutOfMemoryError before anything changed
  if (fetch) {
    try {
      prefetch(id);  // the shard's copy on the host-to-device stream, ahead of the gather there
    } catch (const OutOfMemoryError&) {
      drop_gathered(c);
      throw;
    }
  }
  // The gathered slot may have been freed a moment ago while compute still read it.
  backend_.stream_wait_event(StreamKind::kHostToDevice, backend_.record_event(StreamKind::kCompute));
  communicator_->all_gather(c.shard_ptr(Tier::kDevice), c.gathered_ptr(), c.shard_numel(), c.dtype(),
                            StreamKind::kHostToDevice);
  gathers_in_flight_[id] = backend_.record_event(StreamKind::kHostToDevice);
  traffic_.all_gathers += 1;
  traffic_.gather_prefetches += 1;
}

void ChunkManager::allocate_gathered(ChunkId id) {
  check_finalized("allocate_gathered");
  Chunk& c = mutable_chunk(id);
  GX_CHECK(sharded(), "allocate_gathered of chunk ", id, ": the ChunkManager is not sharded; use allocate_copy().");
  GX_CHECK(!c.gathered(), "allocate_gathered of chunk ", id, ": it is gathered already.");
  add_gathered(c);
}

void ChunkManager::reduce(ChunkId id) {
  check_finalized("reduce");
  Chunk& c = mutable_chunk(id);
  GX_INTERNAL_ASSERT(c.can_reduce(), "reduce of chunk ", id, " with only ", c.count_in(TensorState::kReadyForReduce),
                     " of ", c.num_slots(), " tensors READY_FOR_REDUCE");
  check_can_communicate("reduce", id);
  for (size_t i = 0; i < c.num_slots(); ++i) c.transition(i, TensorState::kHold);
  traffic_.reductions += 1;
}

void ChunkManager::reduce_scatter(ChunkId id) {
  check_finalized("reduce_scatter");
  Chunk& c = mutable_chunk(id);
  GX_CHECK(sharded(), "reduce_scatter of chunk ", id, ": the ChunkManager is not sharded; use reduce().");
  GX_CHECK(c.gathered(), "reduce_scatter of chunk ", id, ": the values to reduce are in the gathered buffer; "
           "allocate_gathered(", id, ") and fill it first.");
  complete_move(id, /*block=*/true);
  if (!c.shard_tiers().contains(Tier::kDevice)) add_copy(c, Tier::kDevice);
  // The sum over ranks of this rank's part overwrites the device copy of the shard; the caller
  // keeps the other copies coherent.
  communicator_->reduce_scatter(c.gathered_ptr(), c.shard_ptr(Tier::kDevice), c.shard_numel(), c.dtype(),
                                ReduceOp::kSum, StreamKind::kCompute);
  traffic_.reduce_scatters += 1;
  drop_gathered(c);
}

}  // namespace gx
