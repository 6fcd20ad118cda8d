// Residency (residency.h): fetches, eviction, prefetch and gathers under the planning budget.
#include "core/residency.h"

#include <algorithm>
#include <chrono>
#include <limits>

#include "core/belady_eviction.h"
#include "core/errors.h"
#include "core/prefetch_planner.h"

namespace gx {

using S = TensorState;

Residency::Residency(const DeviceBackend& backend, ChunkManager& mgr, std::vector<ChunkSet>& sets,
                     const std::vector<int>& set_of_p_chunk, const AccessTrace& trace, OptimizerPipeline& pipeline,
                     Timeline& timeline, const std::string& policy_name)
    : backend_(backend),
      mgr_(mgr),
      sets_(sets),
      set_of_p_chunk_(set_of_p_chunk),
      trace_(trace),
      pipeline_(pipeline),
      timeline_(timeline),
      policy_name_(policy_name) {}

int Residency::set_of_chunk(ChunkId p_chunk) const {
  if (p_chunk < 0 || static_cast<size_t>(p_chunk) >= set_of_p_chunk_.size()) return -1;
  return set_of_p_chunk_[static_cast<size_t>(p_chunk)];
}

void Residency::note(char kind, ChunkId id) { timeline_.note(kind, id, mgr_.tier_bytes(Tier::kDevice).current); }

Tier Residency::where_current(ChunkId id) const {
  const Chunk& c = mgr_.chunk(id);
  if (c.shard_tiers().contains(mgr_.host_tier())) return mgr_.host_tier();
  if (c.shard_tiers().contains(Tier::kDevice)) return Tier::kDevice;
  // A group homed off the manager's host tier (the exact values of frozen parameters live in
  // pageable memory beside pinned chunks) has its one copy there.
  for (Tier t : {Tier::kPinnedHost, Tier::kPageableHost})
    if (c.shard_tiers().contains(t)) return t;
  GX_INTERNAL_ASSERT(false, "chunk ", id, " holds no data on any tier");
}

void Residency::set_budget(int64_t bytes) {
  GX_CHECK(bytes >= 0, "device budget: expected >= 0 bytes (0: the whole device), got ", bytes, ".");
  budget_bytes_ = bytes;
  while (mgr_.tier_bytes(Tier::kDevice).current > budget()) {
    if (!evict_once(-1)) break;  // what cannot go now goes at the next fetch, or fails there
  }
}

void Residency::throw_budget_exceeded(ChunkId id, size_t bytes) {
  int64_t busy = 0, busy_bytes = 0, waiting_bytes = 0, kept_param_bytes = 0, grad_bytes = 0, kept_grad_bytes = 0,
          optim_bytes = 0, gathered_bytes = 0;
  for (const auto& set : sets_) {
    const Chunk& p = mgr_.chunk(set.spec.param);
    if (sharded() && p.gathered()) gathered_bytes += static_cast<int64_t>(p.chunk_bytes());
    if (p.shard_tiers().contains(Tier::kDevice) && !p.can_move()) {
      busy += 1;
      busy_bytes += static_cast<int64_t>(p.shard_bytes());
    } else if (p.shard_tiers().contains(Tier::kDevice) && p.count_in(S::kReadyForReduce) > 0) {
      waiting_bytes += static_cast<int64_t>(p.shard_bytes());
    } else if (p.shard_tiers().contains(Tier::kDevice) && param_kept_on_device(set)) {
      kept_param_bytes += static_cast<int64_t>(p.shard_bytes());
    }
    if (!set.trainable) continue;
    const Chunk& g = mgr_.chunk(set.spec.grad);
    if (sharded() && g.gathered()) gathered_bytes += static_cast<int64_t>(g.chunk_bytes());
    if (g.shard_tiers().contains(Tier::kDevice)) {
      (set.spec.grad_stays_on_device ? kept_grad_bytes : grad_bytes) += static_cast<int64_t>(g.shard_bytes());
    }
    for (ChunkId s : set.spec.optimizer_chunks())
      if (mgr_.chunk(s).shard_tiers().contains(Tier::kDevice))
        optim_bytes += static_cast<int64_t>(mgr_.chunk(s).shard_bytes());
  }
  // The floor: the chunks one module computes with at once (the most seen, or what this access
  // needs), plus one gradient chunk.
  const auto [now_chunks, now_bytes] = in_compute(id);  // id counts if it is a parameter chunk
  const bool peak_larger = compute_peak_bytes_ > now_bytes;
  const int floor_p_chunks = peak_larger ? compute_peak_chunks_ : now_chunks;
  const int64_t floor_p_bytes = peak_larger ? compute_peak_bytes_ : now_bytes;
  const int64_t grad_bytes_floor = largest_grad_bytes();
  const std::string floor = detail::concat(
      " The smallest budget this model trains under is ", sharded() ? "at least " : "about ",
      floor_p_bytes + grad_bytes_floor, " bytes: ",
      floor_p_chunks, " parameter chunk(s) one module computes with at once (", floor_p_bytes, " bytes, the most seen"
      " so far)", grad_bytes_floor > 0 ? detail::concat(" and one gradient chunk (", grad_bytes_floor, " bytes)") : "",
      sharded() ? "; sharded, every further chunk whose gradients are still arriving keeps a gathered gradient "
                  "buffer on top" : "",
      optim_bytes + kept_grad_bytes > 0 ? ", with the optimizer state on the host" : "", ".");
  throw OutOfMemoryError(detail::concat(
      "gemini_ext: out of device memory for chunk ", id, " (", bytes, " bytes) under the '", policy_name_,
      "' policy: the device budget is ", budget(), " bytes and chunks hold ", mgr_.tier_bytes(Tier::kDevice).current,
      " bytes of it, none evictable now: ", busy, " parameter chunks in use by compute (", busy_bytes,
      " bytes), parameter chunks waiting for the rest of their gradients (", waiting_bytes,
      " bytes), gradient chunks still collecting gradients (", grad_bytes, " bytes), parameter chunks (",
      kept_param_bytes, " bytes) and gradient chunks (", kept_grad_bytes,
      " bytes) of optimizer state the host cannot hold, optimizer state kept on the device (", optim_bytes, " bytes)",
      sharded() ? detail::concat(", gathered buffers (", gathered_bytes, " bytes)") : std::string(), ".", floor,
      " Raise gpu_memory_limit (GEMINI_EXT_GPU_LIMIT; sim_capacity on the sim device) or use smaller chunks "
      "(chunk_config_dict / min_chunk_size_m)",
      kept_grad_bytes + kept_param_bytes > 0
          ? ", or use more data-parallel ranks or free host memory (the host cannot hold the "
            "optimizer state kept on the device)."
      : optim_bytes > 0 ? ", or keep more optimizer state on the host (offload_optim_frac closer to 1.0)."
                        : "."));
}

std::pair<int, int64_t> Residency::in_compute(ChunkId also) const {
  int chunks = 0;
  int64_t bytes = 0;
  for (const auto& set : sets_) {
    const Chunk& p = mgr_.chunk(set.spec.param);
    if (set.spec.param == also || p.count_in(S::kCompute) > 0) {
      chunks += 1;
      // sharded: the gathered buffer and the shard it is gathered from
      bytes += static_cast<int64_t>(p.shard_bytes() + (sharded() ? p.chunk_bytes() : 0));
    }
  }
  return {chunks, bytes};
}

int64_t Residency::largest_grad_bytes() const {
  int64_t largest = 0;
  for (const auto& set : sets_)
    if (set.trainable) {
      // sharded: the whole gradients are collected in a gathered buffer and reduce-scattered into the shard
      const Chunk& g = mgr_.chunk(set.spec.grad);
      largest = std::max(largest, static_cast<int64_t>(g.shard_bytes() + (sharded() ? g.chunk_bytes() : 0)));
    }
  return largest;
}

int64_t Residency::device_bytes_needed(ChunkId id, bool gather) const {
  const Chunk& c = mgr_.chunk(id);
  int64_t bytes = c.shard_tiers().contains(Tier::kDevice) ? 0 : static_cast<int64_t>(c.shard_bytes());
  if (gather && sharded() && !c.gathered()) bytes += static_cast<int64_t>(c.chunk_bytes());
  return bytes;
}

void Residency::with_space_for(ChunkId id, const std::function<void()>& fn, int64_t bytes) {
  const Chunk& c = mgr_.chunk(id);
  for (;;) {
    // The planning budget first (it may be below what the backend could allocate), then the
    // backend's own limit (OutOfMemoryError from the pool).
    const int64_t needed = bytes >= 0 ? bytes : device_bytes_needed(id, /*gather=*/false);
    const bool over_budget = needed > 0 && mgr_.tier_bytes(Tier::kDevice).current + needed > budget();
    if (!over_budget) {
      try {
        fn();
        return;
      } catch (const OutOfMemoryError&) {
      }
    }
    if (!evict_once(id))
      throw_budget_exceeded(id, static_cast<size_t>(bytes >= 0 ? bytes : static_cast<int64_t>(c.shard_bytes())));
  }
}

bool Residency::evict_once(ChunkId requester) {
  // First, device copies that finished moving to the host give their slots back.
  bool waited = false;
  for (const auto& set : sets_) {
    if (set.trainable && mgr_.in_flight(set.spec.grad)) {
      mgr_.wait(set.spec.grad);
      waited = true;
    }
  }
  if (waited) return true;
  auto victim = choose_farthest_next_use(evictable(requester), trace_, lru_);
  if (!victim && !pipeline_.pending_sets().empty()) {
    pipeline_.settle(pipeline_.pending_sets().front());  // its chunks become evictable
    return true;
  }
  // The last resort, below the budget that keeps backward's chunks in place: chunks whose set is
  // still collecting gradients in this backward go too (fetched again, or accumulated on the host).
  if (!victim) victim = choose_farthest_next_use(evictable_while_collecting(requester), trace_, lru_);
  if (!victim) return false;
  evict(*victim);
  return true;
}

int64_t Residency::budget() const {
  const auto capacity = static_cast<int64_t>(backend_.device_capacity_bytes());
  return budget_bytes_ > 0 ? std::min(budget_bytes_, capacity) : capacity;
}

void Residency::ensure_on_device(ChunkId id) {
  const bool had = mgr_.chunk(id).shard_tiers().contains(Tier::kDevice);
  const auto t0 = std::chrono::steady_clock::now();
  if (id != last_accessed_) {
    last_accessed_ = id;
    // Only a new chunk in the access stream can raise what computes at once (the budget's floor).
    const auto [chunks, bytes] = in_compute(id);
    if (bytes > compute_peak_bytes_) {
      compute_peak_bytes_ = bytes;
      compute_peak_chunks_ = chunks;
    }
    // The access stream moves to another chunk: idle chunks whose home is the host go back now
    // (evicting them at every module's release would fetch a chunk once per module using it);
    // prefetched chunks not used yet stay.
    for (const auto& set : sets_) {
      const Chunk& p = mgr_.chunk(set.spec.param);
      if (set.spec.param_home_on_host && !params_held_ && set.spec.param != id &&
          p.shard_tiers().contains(Tier::kDevice) &&
          p.can_move() && p.count_in(S::kReadyForReduce) == 0 && !mgr_.in_flight(set.spec.param) &&
          !mgr_.prefetched(set.spec.param) && !mgr_.gather_in_flight(set.spec.param) &&
          !needed_soon(set.spec.param))
        evict(set.spec.param);
      // Sharded, an idle gathered chunk is re-sharded now rather than at its release, so that
      // consecutive modules in one chunk share one all-gather. Every rank sees the same access
      // stream, so every rank drops the same buffers.
      if (sharded() && !set.spec.keep_gathered && set.spec.param != id && p.gathered() && p.can_move() &&
          !mgr_.gather_in_flight(set.spec.param))  // gathered ahead for an access to come: stays
        mgr_.ungather(set.spec.param);
    }
  }
  with_space_for(id, [&] { mgr_.access(id); }, device_bytes_needed(id, /*gather=*/true));
  if (!had) {
    counters_.fetches += 1;
    counters_.sync_fetch_waits += 1;
    counters_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    note('F', id);
  }
  lru_.touch(id);
}

void Residency::ensure_shard_on_device(ChunkId id) {
  mgr_.wait(id);
  if (mgr_.chunk(id).shard_tiers().contains(Tier::kDevice)) {
    lru_.touch(id);
    return;
  }
  const Tier from = where_current(id);
  with_space_for(id, [&] { mgr_.allocate_copy(id, Tier::kDevice); });
  mgr_.transfer(id, from, Tier::kDevice);
  counters_.fetches += 1;
  note('F', id);
  lru_.touch(id);
}

void Residency::prefetch() {
  // Steps that finished are settled now (speculative ones once confirmed), so that their chunks
  // can be prefetched (home-on-device chunks get their refresh copy started here).
  pipeline_.settle_finished();
  if (max_prefetch_ <= 0 || !trace_.usable()) return;
  if (sharded()) {
    prefetch_gathers();
    return;
  }
  prefetch_unsharded(max_prefetch_, PrefetchQuery{}.lookahead);
}

int Residency::prefetch_next_forward() {
  pipeline_.settle_finished();
  if (!trace_.usable() || sharded()) return 0;
  return prefetch_unsharded(std::numeric_limits<int>::max(), trace_.recorded().size());
}

int Residency::prefetch_unsharded(int max_prefetch, size_t lookahead) {
  PrefetchQuery q;
  q.max_prefetch = max_prefetch;
  q.lookahead = lookahead;
  q.free_bytes = budget() - mgr_.tier_bytes(Tier::kDevice).current;
  q.needs_fetch = [&](ChunkId c) {
    return set_of_chunk(c) >= 0 && !pipeline_.pending(set_of_chunk(c)) &&
           !mgr_.chunk(c).shard_tiers().contains(Tier::kDevice) && !mgr_.in_flight(c);
  };
  q.chunk_bytes = [&](ChunkId c) { return static_cast<int64_t>(mgr_.chunk(c).shard_bytes()); };
  int started = 0;
  for (ChunkId c : plan_prefetch(trace_, q)) {
    try {
      mgr_.prefetch(c);
    } catch (const OutOfMemoryError&) {
      break;  // the pools' rounding left less room than the plan assumed: fetch it when needed
    }
    note('P', c);
    started += 1;
  }
  return started;
}

void Residency::prefetch_gathers() {
  // Sharded: the next chunks are gathered ahead (their shards fetched first when needed). A
  // gather is a collective, so the choice uses only what every rank shares: the recorded order,
  // which chunks are gathered, and a byte cap for gathered buffers of half the budget (the
  // budget is the same everywhere). Room for the shard copies is made by evicting, as a fetch
  // would; a rank that cannot make room fails with the OutOfMemoryError.
  PrefetchQuery q;
  q.max_prefetch = max_prefetch_;
  q.free_bytes = budget() / 2 - mgr_.gathered_bytes().current;
  // Not whether a set's CPU step is still pending: that differs between ranks, and a gather is a
  // collective. A planned gather waits for its set's step instead.
  q.needs_fetch = [&](ChunkId c) { return set_of_chunk(c) >= 0 && !mgr_.chunk(c).gathered(); };
  q.chunk_bytes = [&](ChunkId c) { return static_cast<int64_t>(mgr_.chunk(c).chunk_bytes()); };
  for (ChunkId c : plan_prefetch(trace_, q)) {
    pipeline_.settle(set_of_chunk(c));
    with_space_for(c, [&] { mgr_.prefetch_gather(c); }, device_bytes_needed(c, /*gather=*/true));
    note('P', c);
  }
}

void Residency::allocate_on_device(ChunkId id) {
  with_space_for(id, [&] { mgr_.allocate_copy(id, Tier::kDevice); });
}

bool Residency::needed_soon(ChunkId id) const {
  if (!trace_.usable()) return false;
  const size_t from = trace_.position();
  const size_t next = trace_.next_use(id, from);
  return next != AccessTrace::kNever && next - from < kSoonAccesses;
}

bool Residency::hold_params() {
  if (sharded()) return false;  // each forward gathers: a collective the hooks issue
  for (const auto& set : sets_)
    if (!mgr_.chunk(set.spec.param).shard_tiers().contains(Tier::kDevice)) return false;
  for (const auto& set : sets_) mgr_.access(set.spec.param);  // a copy in flight: compute waits for it
  params_held_ = true;
  return true;
}

bool Residency::param_kept_on_device(const ChunkSet& set) const {
  // The set's state is on the device because the host has no room for it, and its parameter
  // chunk was born on the device: the host plan has no copy of it either.
  return set.spec.grad_stays_on_device && !mgr_.chunk(set.spec.param).shard_tiers().contains(mgr_.host_tier());
}

std::vector<ChunkId> Residency::evictable(ChunkId requester) const {
  std::vector<ChunkId> out;
  for (const auto& set : sets_) {
    const Chunk& p = mgr_.chunk(set.spec.param);
    // A set whose CPU step is pending: its P device copy may go only as a free drop (the host
    // copy, which the step writes, is the truth), never by a move that would write the host.
    if (pipeline_.pending(set_of_chunk(set.spec.param)) && !p.shard_tiers().contains(mgr_.host_tier())) continue;
    // A parameter chunk may go when it is released or releasable: no tensor in COMPUTE and none
    // waiting for reduction (all HOLD / HOLD_AFTER_BWD).
    if (set.spec.param != requester && p.shard_tiers().contains(Tier::kDevice) && p.can_move() &&
        p.count_in(S::kReadyForReduce) == 0 && pinned_.count(set.spec.param) == 0 && !params_held_ &&
        !mgr_.gather_in_flight(set.spec.param) &&  // a prefetched gather still reads the shard
        !param_kept_on_device(set))
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

std::vector<ChunkId> Residency::evictable_while_collecting(ChunkId requester) const {
  std::vector<ChunkId> out;
  if (sharded()) return out;  // sharded, a set collecting gradients holds a gathered buffer to reduce-scatter
  for (const auto& set : sets_) {
    const Chunk& p = mgr_.chunk(set.spec.param);
    if (!set.trainable || p.count_in(S::kReadyForReduce) == 0) continue;  // not collecting: evictable() decides
    if (pipeline_.pending(set_of_chunk(set.spec.param))) continue;       // settled by evict_once first
    // A parameter chunk waiting for the rest of its gradients: nothing writes its values (the
    // gradients go to the gradient chunk), so it may go and be fetched again for the tensors
    // whose backward is still to come.
    if (set.spec.param != requester && p.shard_tiers().contains(Tier::kDevice) && p.can_move() &&
        pinned_.count(set.spec.param) == 0 && !params_held_ && !mgr_.in_flight(set.spec.param) &&
        !param_kept_on_device(set))
      out.push_back(set.spec.param);
    // A gradient chunk still collecting: it moves to the host, where the gradients still to come
    // are added (as for accumulation after a reduction).
    if (!set.spec.grad_stays_on_device && set.spec.grad != requester && set.grad_place == GradPlace::kDevice &&
        pinned_.count(set.spec.grad) == 0 && !mgr_.in_flight(set.spec.grad) &&
        mgr_.chunk(set.spec.grad).shard_tiers().contains(Tier::kDevice))
      out.push_back(set.spec.grad);
  }
  return out;
}

void Residency::evict(ChunkId id) {
  const Chunk& c = mgr_.chunk(id);
  if (!c.shard_tiers().contains(Tier::kDevice)) return;
  const auto t0 = std::chrono::steady_clock::now();
  struct Done {  // counts the time and notes the event however the eviction below returns
    Residency& m;
    ChunkId id;
    std::chrono::steady_clock::time_point t0;
    ~Done() {
      m.counters_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      m.note('E', id);
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

void Residency::release_if_idle(ChunkId id) {
  const Chunk& c = mgr_.chunk(id);
  if (c.count_in(S::kCompute) != 0) return;
  if (!c.gathered() || !c.can_release()) return;
  // Sharded, the buffer stays until the access stream moves to another chunk (see
  // ensure_on_device_locked), or, kept gathered, until the chunk's gradients are reduced.
  mgr_.release(id, /*reshard=*/!sharded());
}

void Residency::ungather_kept(const ChunkSet& set) {
  const Chunk& c = mgr_.chunk(set.spec.param);
  if (sharded() && c.gathered() && c.can_move()) mgr_.ungather(set.spec.param);
}

void Residency::ungather_all_kept() {
  for (const ChunkSet& set : sets_) ungather_kept(set);
}

}  // namespace gx
