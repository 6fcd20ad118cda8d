// GeminiManager, part 2: residency. Which chunk is on the device: fetches under the planning
// budget, eviction (farthest next use, LRU before a trace exists), prefetch, moving optimizer
// state between tiers, and the timeline of these events. See gemini_manager.h.
#include <algorithm>

#include "core/belady_eviction.h"
#include "core/errors.h"
#include "core/memory_pressure.h"
#include "core/prefetch_planner.h"
#include "torch/gemini_manager.h"

namespace gx::torch_layer {

using S = TensorState;

void GeminiManager::throw_budget_exceeded(ChunkId id, size_t bytes) {
  int64_t busy = 0, busy_bytes = 0, waiting_bytes = 0, grad_bytes = 0, kept_grad_bytes = 0, optim_bytes = 0,
          gathered_bytes = 0;
  for (const auto& set : sets_) {
    const Chunk& p = mgr_.chunk(set.spec.param);
    if (sharded() && p.gathered()) gathered_bytes += static_cast<int64_t>(p.chunk_bytes());
    if (p.shard_tiers().contains(Tier::kDevice) && !p.can_move()) {
      busy += 1;
      busy_bytes += static_cast<int64_t>(p.shard_bytes());
    } else if (p.shard_tiers().contains(Tier::kDevice) && p.count_in(S::kReadyForReduce) > 0) {
      waiting_bytes += static_cast<int64_t>(p.shard_bytes());
    }
    if (!set.trainable) continue;
    const Chunk& g = mgr_.chunk(set.spec.grad);
    if (sharded() && g.gathered()) gathered_bytes += static_cast<int64_t>(g.chunk_bytes());
    if (g.shard_tiers().contains(Tier::kDevice)) {
      (set.spec.grad_stays_on_device ? kept_grad_bytes : grad_bytes) += static_cast<int64_t>(g.shard_bytes());
    }
    for (ChunkId s : {set.spec.master, set.spec.exp_avg, set.spec.exp_avg_sq})
      if (s >= 0 && mgr_.chunk(s).shard_tiers().contains(Tier::kDevice))
        optim_bytes += static_cast<int64_t>(mgr_.chunk(s).shard_bytes());
  }
  throw OutOfMemoryError(detail::concat(
      "gemini_ext: out of device memory for chunk ", id, " (", bytes, " bytes) under the '", policy_name_,
      "' policy: the device budget is ", device_budget_locked(), " bytes and chunks hold ",
      mgr_.tier_bytes(Tier::kDevice).current, " bytes of it, none evictable now: ", busy,
      " parameter chunks in use by compute (", busy_bytes, " bytes), parameter chunks waiting for the rest of their "
      "gradients (", waiting_bytes, " bytes), gradient chunks still collecting gradients (",
      grad_bytes, " bytes), gradient chunks of optimizer state the host cannot hold (", kept_grad_bytes,
      " bytes), optimizer state kept on the device (", optim_bytes, " bytes)",
      sharded() ? detail::concat(", gathered buffers (", gathered_bytes, " bytes)") : std::string(),
      ". Raise gpu_memory_limit (GEMINI_EXT_GPU_LIMIT; sim_capacity on the sim device) or use smaller chunks "
      "(chunk_config_dict / min_chunk_size_m)",
      kept_grad_bytes > 0 ? ", or use more data-parallel ranks or free host memory (the host cannot hold the "
                            "optimizer state kept on the device)."
      : optim_bytes > 0   ? ", or keep more optimizer state on the host (offload_optim_frac closer to 1.0)."
                          : "."));
}

int64_t GeminiManager::device_bytes_needed_locked(ChunkId id, bool gather) const {
  const Chunk& c = mgr_.chunk(id);
  int64_t bytes = c.shard_tiers().contains(Tier::kDevice) ? 0 : static_cast<int64_t>(c.shard_bytes());
  if (gather && sharded() && !c.gathered()) bytes += static_cast<int64_t>(c.chunk_bytes());
  return bytes;
}

void GeminiManager::with_room_locked(ChunkId id, const std::function<void()>& fn, int64_t bytes) {
  const Chunk& c = mgr_.chunk(id);
  for (;;) {
    // The planning budget first (it may be below what the backend could allocate), then the
    // backend's own limit (OutOfMemoryError from the pool).
    const int64_t needed = bytes >= 0 ? bytes : device_bytes_needed_locked(id, /*gather=*/false);
    const bool over_budget = needed > 0 && mgr_.tier_bytes(Tier::kDevice).current + needed > device_budget_locked();
    if (!over_budget) {
      try {
        fn();
        return;
      } catch (const OutOfMemoryError&) {
      }
    }
    if (!make_room_locked(id))
      throw_budget_exceeded(id, static_cast<size_t>(bytes >= 0 ? bytes : static_cast<int64_t>(c.shard_bytes())));
  }
}

bool GeminiManager::make_room_locked(ChunkId requester) {
  // First, device copies that finished moving to the host give their slots back.
  bool waited = false;
  for (const auto& set : sets_) {
    if (set.trainable && mgr_.in_flight(set.spec.grad)) {
      mgr_.wait(set.spec.grad);
      waited = true;
    }
  }
  if (waited) return true;
  auto victim = choose_farthest_next_use(evictable_locked(requester), trace_, lru_);
  if (!victim && !pending_order_.empty()) {
    settle_locked(pending_order_.front());  // its chunks become evictable
    return true;
  }
  if (!victim) return false;
  evict_locked(*victim);
  return true;
}

int64_t GeminiManager::device_budget_locked() const {
  const auto capacity = static_cast<int64_t>(ctx_->backend().device_capacity_bytes());
  return budget_bytes_ > 0 ? std::min(budget_bytes_, capacity) : capacity;
}

void GeminiManager::set_device_budget(int64_t bytes) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  settle_all_locked();
  GX_CHECK(bytes >= 0, "device budget: expected >= 0 bytes (0: the whole device), got ", bytes, ".");
  budget_bytes_ = bytes;
  while (mgr_.tier_bytes(Tier::kDevice).current > device_budget_locked()) {
    if (!make_room_locked(-1)) break;  // what cannot go now goes at the next fetch, or fails there
  }
}

size_t GeminiManager::reclaim_device_bytes(size_t bytes) {
  if (mutex_.held_by_this_thread()) return 0;  // an allocation inside one of our own calls
  std::unique_lock<OwnedMutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock()) return 0;  // another thread is in the manager: waiting could deadlock
  const int64_t before = mgr_.tier_bytes(Tier::kDevice).current;
  // What counts is memory handed back to the device, not chunk bytes evicted: a slot carved from
  // a group's arena extent returns only when the whole extent is free. So evict one chunk at a
  // time and trim after each (trim waits for the slots' last uses), until enough came back or
  // nothing else may go (chunks in COMPUTE stay).
  size_t released = mgr_.trim(Tier::kDevice);  // free slots cached by the pools
  while (released < bytes && make_room_locked(-1)) released += mgr_.trim(Tier::kDevice);
  counters_.reclaims += 1;
  counters_.reclaimed_bytes += before - mgr_.tier_bytes(Tier::kDevice).current;
  return released;
}

int64_t GeminiManager::device_budget() const {
  return device_budget_locked();
}

void GeminiManager::set_optim_on_host(int set_index, bool on_host) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  GX_CHECK(set_index >= 0 && static_cast<size_t>(set_index) < sets_.size(), "chunk set index: expected in [0, ",
           sets_.size(), "), got ", set_index, ".");
  GX_CHECK(!in_backward_, "set_optim_on_host during backward: change placement between steps.");
  settle_all_locked();
  ChunkSet& set = sets_[static_cast<size_t>(set_index)];
  GX_CHECK(set.trainable, "chunk set ", set_index, " holds frozen parameters: it has no optimizer state to place.");
  if (set.spec.optim_on_host == on_host) return;
  ctx_->sync_compute_stream();
  const Tier host = mgr_.host_tier();
  const Tier to = on_host ? host : Tier::kDevice;
  for (ChunkId id : {set.spec.master, set.spec.exp_avg, set.spec.exp_avg_sq}) {
    if (id < 0) continue;
    if (to == Tier::kDevice) {
      with_room_locked(id, [&] { mgr_.move(id, to); });
    } else {
      mgr_.move(id, to);
    }
  }
  const ChunkId p = set.spec.param;
  if (on_host) set.spec.grad_stays_on_device = false;  // the host holds the whole set now
  if (on_host) {
    // CPU Adam needs P's permanent host copy: bring the truth there (keeping the device copy).
    mgr_.wait(p);
    const Chunk& pc = mgr_.chunk(p);
    if (!pc.shard_tiers().contains(host)) {
      mgr_.allocate_copy(p, host);
      mgr_.transfer(p, Tier::kDevice, host);
    }
    if (!mgr_.chunk(set.spec.grad).shard_tiers().contains(host)) mgr_.allocate_copy(set.spec.grad, host);
  }
  set.spec.optim_on_host = on_host;
}

void GeminiManager::ensure_on_device_locked(ChunkId id) {
  const bool had = mgr_.chunk(id).shard_tiers().contains(Tier::kDevice);
  const auto t0 = std::chrono::steady_clock::now();
  if (id != last_accessed_) {
    last_accessed_ = id;
    // The access stream moves to another chunk: idle chunks whose home is the host go back now
    // (evicting them at every module's release would fetch a chunk once per module using it);
    // prefetched chunks not used yet stay.
    for (const auto& set : sets_) {
      const Chunk& p = mgr_.chunk(set.spec.param);
      if (set.spec.param_home_on_host && set.spec.param != id && p.shard_tiers().contains(Tier::kDevice) &&
          p.can_move() && p.count_in(S::kReadyForReduce) == 0 && !mgr_.in_flight(set.spec.param) &&
          !mgr_.prefetched(set.spec.param) && !mgr_.gather_in_flight(set.spec.param))
        evict_locked(set.spec.param);
      // Sharded, an idle gathered chunk is re-sharded now rather than at its release, so that
      // consecutive modules in one chunk share one all-gather. Every rank sees the same access
      // stream, so every rank drops the same buffers.
      if (sharded() && !set.spec.keep_gathered && set.spec.param != id && p.gathered() && p.can_move() &&
          !mgr_.gather_in_flight(set.spec.param))  // gathered ahead for an access to come: stays
        mgr_.ungather(set.spec.param);
    }
  }
  with_room_locked(id, [&] { mgr_.access(id); }, device_bytes_needed_locked(id, /*gather=*/true));
  if (!had) {
    counters_.fetches += 1;
    counters_.sync_fetch_waits += 1;
    counters_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    note_locked('F', id);
  }
  lru_.touch(id);
}

void GeminiManager::ensure_shard_on_device_locked(ChunkId id) {
  mgr_.wait(id);
  if (mgr_.chunk(id).shard_tiers().contains(Tier::kDevice)) {
    lru_.touch(id);
    return;
  }
  const Tier from = where_current(id);
  with_room_locked(id, [&] { mgr_.allocate_copy(id, Tier::kDevice); });
  mgr_.transfer(id, from, Tier::kDevice);
  counters_.fetches += 1;
  note_locked('F', id);
  lru_.touch(id);
}

void GeminiManager::note_locked(char kind, ChunkId id) {
  constexpr size_t kMaxEvents = size_t{1} << 16;
  TimelineEvent e{std::chrono::duration<double>(std::chrono::steady_clock::now() - created_).count(), kind, id,
                  mgr_.tier_bytes(Tier::kDevice).current};
  if (timeline_.size() < kMaxEvents) {
    timeline_.push_back(e);
  } else {
    timeline_[timeline_next_] = e;
    timeline_next_ = (timeline_next_ + 1) % kMaxEvents;
  }
}

std::vector<TimelineEvent> GeminiManager::timeline() const {
  std::vector<TimelineEvent> out(timeline_.begin() + static_cast<std::ptrdiff_t>(timeline_next_), timeline_.end());
  out.insert(out.end(), timeline_.begin(), timeline_.begin() + static_cast<std::ptrdiff_t>(timeline_next_));
  return out;
}

void GeminiManager::settle_finished_locked() {
  // Steps that finished are settled now (speculative ones once confirmed), so that their chunks can be
  // prefetched (home-on-device chunks get their refresh copy started here).
  for (int s : pending_sets_locked()) {
    const PendingStep& p = pending_.at(s);
    if (p.eager && !p.eager()) continue;  // speculative, not confirmed yet
    try_settle_locked(s);                   // only if it finished
  }
}

void GeminiManager::prefetch_locked() {
  settle_finished_locked();
  if (max_prefetch_ <= 0 || !trace_.usable()) return;
  if (sharded()) {
    prefetch_gathers_locked();
    return;
  }
  PrefetchQuery q;
  q.max_prefetch = max_prefetch_;
  q.free_bytes = device_budget_locked() - mgr_.tier_bytes(Tier::kDevice).current;
  q.needs_fetch = [&](ChunkId c) {
    return set_of_chunk(c) >= 0 && !pending_locked(set_of_chunk(c)) &&
           !mgr_.chunk(c).shard_tiers().contains(Tier::kDevice) && !mgr_.in_flight(c);
  };
  q.chunk_bytes = [&](ChunkId c) { return static_cast<int64_t>(mgr_.chunk(c).shard_bytes()); };
  for (ChunkId c : plan_prefetch(trace_, q)) {
    try {
      mgr_.prefetch(c);
    } catch (const OutOfMemoryError&) {
      break;  // the pools' rounding left less room than the plan assumed: fetch it when needed
    }
    note_locked('P', c);
  }
}

void GeminiManager::prefetch_gathers_locked() {
  // Sharded: the next chunks are gathered ahead (their shards fetched first when needed). A
  // gather is a collective, so the choice uses only what every rank shares: the recorded order,
  // which chunks are gathered, and a byte cap for gathered buffers of half the budget (the
  // budget is the same everywhere). Room for the shard copies is made by evicting, as a fetch
  // would; a rank that cannot make room fails with the OutOfMemoryError.
  PrefetchQuery q;
  q.max_prefetch = max_prefetch_;
  q.free_bytes = device_budget_locked() / 2 - mgr_.gathered_bytes().current;
  // Not whether a set's CPU step is still pending: that differs between ranks, and a gather is a
  // collective. A planned gather waits for its set's step instead.
  q.needs_fetch = [&](ChunkId c) { return set_of_chunk(c) >= 0 && !mgr_.chunk(c).gathered(); };
  q.chunk_bytes = [&](ChunkId c) { return static_cast<int64_t>(mgr_.chunk(c).chunk_bytes()); };
  for (ChunkId c : plan_prefetch(trace_, q)) {
    settle_locked(set_of_chunk(c));
    with_room_locked(c, [&] { mgr_.prefetch_gather(c); }, device_bytes_needed_locked(c, /*gather=*/true));
    note_locked('P', c);
  }
}

void GeminiManager::allocate_on_device_locked(ChunkId id) {
  with_room_locked(id, [&] { mgr_.allocate_copy(id, Tier::kDevice); });
}

std::vector<ChunkId> GeminiManager::evictable_locked(ChunkId requester) const {
  std::vector<ChunkId> out;
  for (const auto& set : sets_) {
    const Chunk& p = mgr_.chunk(set.spec.param);
    // A set whose CPU step is pending: its P device copy may go only as a free drop (the host
    // copy, which the step writes, is the truth), never by a move that would write the host.
    if (pending_locked(set_of_chunk(set.spec.param)) && !p.shard_tiers().contains(mgr_.host_tier())) continue;
    // A parameter chunk may go when it is released or releasable: no tensor in COMPUTE and none
    // waiting for reduction (all HOLD / HOLD_AFTER_BWD).
    if (set.spec.param != requester && p.shard_tiers().contains(Tier::kDevice) && p.can_move() &&
        p.count_in(S::kReadyForReduce) == 0 && pinned_.count(set.spec.param) == 0 &&
        !mgr_.gather_in_flight(set.spec.param))  // a prefetched gather still reads the shard
      out.push_back(set.spec.param);
    // A gradient chunk on the device that no backward is still writing into (its parameter
    // chunk has no tensor waiting for reduction) can wait for the step on the host, unless the
    // host has no room for it (grad_stays_on_device).
    if (set.trainable && !set.spec.grad_stays_on_device && set.spec.grad != requester &&
        set.grad_place == GradPlace::kDevice &&
        pinned_.count(set.spec.grad) == 0 &&
        !mgr_.in_flight(set.spec.grad) && p.count_in(S::kReadyForReduce) == 0 &&
        mgr_.chunk(set.spec.grad).shard_tiers().contains(Tier::kDevice))
      out.push_back(set.spec.grad);
  }
  return out;
}

void GeminiManager::evict_locked(ChunkId id) {
  const Chunk& c = mgr_.chunk(id);
  if (!c.shard_tiers().contains(Tier::kDevice)) return;
  const auto t0 = std::chrono::steady_clock::now();
  struct Done {  // counts the time and notes the event however the eviction below returns
    GeminiManager& m;
    ChunkId id;
    std::chrono::steady_clock::time_point t0;
    ~Done() {
      m.counters_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      m.note_locked('E', id);
    }
  } done{*this, id, t0};
  if (set_of_chunk(id) < 0) {  // a gradient chunk (see evictable_locked)
    for (auto& set : sets_) {
      if (set.spec.grad != id) continue;
      if (c.shard_tiers().contains(mgr_.host_tier())) mgr_.discard_copy(id, mgr_.host_tier());
      mgr_.move(id, mgr_.host_tier());
      set.grad_place = GradPlace::kHost;
      counters_.evictions += 1;
      counters_.evicted_bytes += static_cast<int64_t>(c.shard_bytes());
      return;
    }
    GX_INTERNAL_ASSERT(false, "eviction of chunk ", id, ", which is neither a parameter nor a gradient chunk");
  }
  if (!sharded() && c.gathered()) mgr_.release(id);  // sharded, the gathered buffer is not this copy
  counters_.evictions += 1;
  counters_.evicted_bytes += static_cast<int64_t>(c.shard_bytes());
  if (c.shard_tiers().contains(mgr_.host_tier())) {
    mgr_.discard_copy(id, Tier::kDevice);  // the host copy is current: dropping the cache is free
  } else {
    mgr_.move(id, mgr_.host_tier());
  }
}

void GeminiManager::release_if_idle_locked(ChunkId id) {
  const Chunk& c = mgr_.chunk(id);
  if (c.count_in(S::kCompute) != 0) return;
  if (!c.gathered() || !c.can_release()) return;
  // Sharded, the buffer stays until the access stream moves to another chunk (see
  // ensure_on_device_locked), or, kept gathered, until the chunk's gradients are reduced.
  mgr_.release(id, /*reshard=*/!sharded());
}

void GeminiManager::ungather_all_locked() {
  for (auto& set : sets_) ungather_kept_locked(set);
}

void GeminiManager::ungather_kept_locked(ChunkSet& set) {
  const Chunk& c = mgr_.chunk(set.spec.param);
  if (sharded() && c.gathered() && c.can_move()) mgr_.ungather(set.spec.param);
}

}  // namespace gx::torch_layer
