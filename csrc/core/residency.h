// Residency: which chunks are on the device, under the planning budget.
//
// Design note. A part of the GeminiManager: no lock of its own, called under the manager's.
// Torch-free: it works on the ChunkManager, the chunk sets, the recorded trace and the optimizer
// pipeline, asks the backend only for the device's capacity, and counts its fetches and
// evictions in counters of its own (the manager merges them into the engine's).
//  * Fetch. A compute access makes a chunk's copy current on the device (sharded: gathered);
//    fetching a chunk that does not fit first waits for gradient moves in flight (their device
//    slots come back), then evicts the evictable chunk used farthest in the future (LRU before a
//    trace exists) and retries; when nothing can go, a pending CPU step is settled (its chunks
//    become evictable); when that fails too, the OutOfMemoryError names the budget, what is
//    resident and the knobs.
//  * Evictable: a parameter chunk with no tensor in COMPUTE or waiting for reduction, not pinned
//    by the optimizer and not read by a gather in flight; a gradient chunk no backward still
//    writes into (it waits for the step on the host), unless its set's state is on the device
//    because the host has no room (grad_stays_on_device); such a set's parameter chunk stays
//    too when it was born on the device (no host copy: the host plan has no room for one). A set
//    whose CPU step is pending only loses P's device copy as a free drop.
//  * The last resort (unsharded), when nothing above can go: a set still collecting gradients
//    gives up its parameter chunk (fetched again if a later backward needs it) or its gradient
//    chunk (moved to the host, where later gradients are added). So any budget holding the
//    chunks one module computes with, plus one gradient chunk, trains; accumulation under
//    no_sync too, since its gradients may wait on the host.
//  * Home on the host (offload_param_frac): such a chunk's device copy is dropped (or moved back)
//    when the access stream fetches a different chunk and it is idle, so each use phase
//    (forward, backward) fetches it about once. Sharded, an idle gathered chunk is re-sharded at
//    that moment too, so that consecutive modules in one chunk share one all-gather.
//  * Held (hold_params): a generation's parameter chunks, all on the device, none evictable.
//  * Prefetch follows the recorded trace: unsharded, shard copies into free budget; sharded,
//    gathers (a collective: chosen only from what every rank shares).
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/access_trace.h"
#include "core/chunk_manager.h"
#include "core/chunk_set.h"
#include "core/device_backend.h"
#include "core/lru_eviction.h"
#include "core/optimizer_pipeline.h"
#include "core/timeline.h"

namespace gx {

// What residency did so far: synchronous fetches, evictions and the host time they took.
struct ResidencyCounters {
  int64_t fetches = 0;
  int64_t sync_fetch_waits = 0;
  double wait_seconds = 0.0;  // host time spent in synchronous fetches and evictions
  int64_t evictions = 0;
  int64_t evicted_bytes = 0;
};

class Residency {
 public:
  // set_of_p_chunk: the set index per chunk id (-1 for companion chunks); policy_name names the
  // placement policy in out-of-memory messages.
  Residency(const DeviceBackend& backend, ChunkManager& mgr, std::vector<ChunkSet>& sets,
            const std::vector<int>& set_of_p_chunk, const AccessTrace& trace, OptimizerPipeline& pipeline,
            Timeline& timeline, const std::string& policy_name);

  // The device bytes chunks may hold (0: the backend's capacity); lowering it evicts what can go now.
  void set_budget(int64_t bytes);
  int64_t budget() const;
  void set_max_prefetch(int max_prefetch) { max_prefetch_ = max_prefetch; }

  void ensure_on_device(ChunkId id);
  // Sharded: this rank's shard of id on the device (a fetch keeps the host copy); no gathering.
  void ensure_shard_on_device(ChunkId id);
  void allocate_on_device(ChunkId id);
  // Runs fn (which allocates on the device for chunk id); on OutOfMemoryError or over the budget
  // makes room and retries, until fn succeeds or nothing is left (then OutOfMemoryError).
  // bytes: what fn adds to the device (-1: the shard, when it is not on the device yet).
  void with_space_for(ChunkId id, const std::function<void()>& fn, int64_t bytes = -1);
  bool evict_once(ChunkId requester);  // frees device bytes once; false if nothing can go
  void evict(ChunkId id);
  void release_if_idle(ChunkId id);
  void prefetch();
  // Unsharded: starts copying the chunks the next forward computes with first, in its recorded
  // order, as many as the budget holds beside what is on the device (not max_prefetch): a phase
  // that gave the device up hands it back before the forward asks (StatePhases' reload).
  // Returns the chunks whose copies started; none sharded (a gather is a collective).
  int prefetch_next_forward();
  // A generation whose parameter chunks all fit (unsharded): each stays on the device, chosen by no
  // eviction, until release_params(), while the module hooks are off and nothing would fetch one
  // back; a copy still landing is waited for on the compute stream. False, holding nothing, where
  // a parameter chunk is not on the device or the chunks are sharded.
  bool hold_params();
  void release_params() { params_held_ = false; }
  void touch(ChunkId id) { lru_.touch(id); }
  // Chunks the optimizer is working on: never chosen for eviction while pinned.
  void pin(ChunkId id) { pinned_.insert(id); }
  void unpin_all() { pinned_.clear(); }
  Tier where_current(ChunkId id) const;  // a tier holding a current copy
  int64_t device_bytes_needed(ChunkId id, bool gather) const;
  void note(char kind, ChunkId id);  // a timeline event with the device bytes after it
  // Sharded: frees P's gathered buffer kept from compute (keep_gathered, or not yet released),
  // when nothing computes on it; every set's with ungather_all_kept (before values change).
  void ungather_kept(const ChunkSet& set);
  void ungather_all_kept();
  const ResidencyCounters& counters() const { return counters_; }

 private:
  void prefetch_gathers();
  int prefetch_unsharded(int max_prefetch, size_t lookahead);
  bool param_kept_on_device(const ChunkSet& set) const;
  // The recorded order uses `id` again within kSoonAccesses accesses from now (a layer whose
  // parameters straddle two chunks alternates between them): sending it home now would fetch it
  // again at once.
  bool needed_soon(ChunkId id) const;
  static constexpr size_t kSoonAccesses = 8;
  std::vector<ChunkId> evictable(ChunkId requester) const;
  // Chunks of sets still collecting gradients in this backward: evicted only when evictable()
  // has none (unsharded).
  std::vector<ChunkId> evictable_while_collecting(ChunkId requester) const;
  [[noreturn]] void throw_budget_exceeded(ChunkId id, size_t bytes);
  // Parameter chunks in COMPUTE on the device, with `also` counted if it is a parameter chunk
  // not among them: (chunks, bytes; sharded, a chunk's bytes are its shard and gathered buffer).
  std::pair<int, int64_t> in_compute(ChunkId also) const;
  int64_t largest_grad_bytes() const;  // one gradient chunk's device bytes (sharded: shard + gathered)
  int set_of_chunk(ChunkId p_chunk) const;
  bool sharded() const { return mgr_.sharded(); }

  const DeviceBackend& backend_;
  ChunkManager& mgr_;
  std::vector<ChunkSet>& sets_;
  const std::vector<int>& set_of_p_chunk_;
  const AccessTrace& trace_;
  OptimizerPipeline& pipeline_;
  ResidencyCounters counters_;
  Timeline& timeline_;
  const std::string& policy_name_;
  LruEviction lru_;
  int max_prefetch_ = 0;
  int64_t budget_bytes_ = 0;
  ChunkId last_accessed_ = -1;
  // The most parameter chunks one module has computed with at once (the budget's floor, with one
  // gradient chunk): (chunks, bytes) at the largest bytes seen.
  int compute_peak_chunks_ = 0;
  int64_t compute_peak_bytes_ = 0;
  std::set<ChunkId> pinned_;
  bool params_held_ = false;
};

}  // namespace gx
