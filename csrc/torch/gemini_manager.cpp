#include "torch/gemini_manager.h"

#include <algorithm>

#include "core/belady_eviction.h"
#include "core/errors.h"
#include "core/prefetch_planner.h"
#include "torch/dtype_map.h"

namespace gx::torch_layer {

using S = TensorState;

GeminiManager::GeminiManager(std::shared_ptr<DeviceContext> ctx, ChunkManager& mgr, std::vector<ChunkSetSpec> specs,
                             std::vector<ParamSpec> params, std::string policy_name)
    : ctx_(std::move(ctx)), mgr_(mgr), params_(std::move(params)), policy_name_(std::move(policy_name)) {
  GX_CHECK(mgr_.finalized(), "GeminiManager: the ChunkManager must be finalized first.");
  set_of_p_chunk_.assign(mgr_.num_chunks(), -1);
  for (const auto& spec : specs) {
    ChunkSet set;
    set.spec = spec;
    set.trainable = spec.grad >= 0;
    const Chunk& p = mgr_.chunk(spec.param);
    GX_INTERNAL_ASSERT(set_of_p_chunk_[static_cast<size_t>(spec.param)] < 0, "chunk ", spec.param, " in two sets");
    for (ChunkId companion : {spec.grad, spec.master, spec.exp_avg, spec.exp_avg_sq}) {
      if (companion < 0) continue;
      const Chunk& c = mgr_.chunk(companion);
      GX_INTERNAL_ASSERT(c.num_slots() == p.num_slots() && c.padded_numel() == p.padded_numel(), "chunk ", companion,
                         " does not share the layout of parameter chunk ", spec.param);
      for (size_t k = 0; k < p.num_slots(); ++k)
        GX_INTERNAL_ASSERT(c.slot(k).offset_numel == p.slot(k).offset_numel, "slot ", k, " of chunk ", companion,
                           " is not at the offset of its parameter");
    }
    GX_INTERNAL_ASSERT(!set.trainable || (spec.exp_avg >= 0 && spec.exp_avg_sq >= 0), "trainable chunk ",
                       spec.param, " without optimizer state chunks");
    set.params.assign(p.num_slots(), -1);
    set.has_grad.assign(p.num_slots(), 0);
    set.step.assign(p.num_slots(), 0);
    set_of_p_chunk_[static_cast<size_t>(spec.param)] = static_cast<int>(sets_.size());
    sets_.push_back(std::move(set));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const int s = set_of_chunk(params_[i].chunk);
    GX_INTERNAL_ASSERT(s >= 0, "parameter ", i, " is in chunk ", params_[i].chunk, ", which is no parameter chunk");
    GX_INTERNAL_ASSERT(params_[i].trainable == sets_[static_cast<size_t>(s)].trainable, "parameter ", i,
                       " is in a chunk of the other kind (trainable / frozen)");
    sets_[static_cast<size_t>(s)].params.at(params_[i].slot) = static_cast<int>(i);
  }
  for (const auto& set : sets_)
    for (int p : set.params) GX_INTERNAL_ASSERT(p >= 0, "a slot of chunk ", set.spec.param, " has no parameter");
  forward_refs_.assign(params_.size(), 0);
  backward_claimed_.assign(params_.size(), 0);
  storages_ = std::make_unique<ParamStorages>(mgr_, ctx_->device_for(Tier::kDevice));
  mgr_.set_listener(storages_.get());
}

GeminiManager::~GeminiManager() {
  mgr_.set_listener(nullptr);
  storages_->unbind_all();
}

int GeminiManager::set_of_chunk(ChunkId p_chunk) const {
  if (p_chunk < 0 || static_cast<size_t>(p_chunk) >= set_of_p_chunk_.size()) return -1;
  return set_of_p_chunk_[static_cast<size_t>(p_chunk)];
}

void GeminiManager::check_param(int param) const {
  GX_CHECK(param >= 0 && static_cast<size_t>(param) < params_.size(), "parameter index: expected in [0, ",
           params_.size(), "), got ", param, ".");
}

void GeminiManager::check_module(int module) const {
  GX_CHECK(module >= 0 && static_cast<size_t>(module) < modules_.size(), "module index: expected in [0, ",
           modules_.size(), "), got ", module, ".");
}

std::vector<at::Tensor> GeminiManager::param_views() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<at::Tensor> views;
  views.reserve(params_.size());
  for (const auto& p : params_) views.push_back(storages_->view(p.chunk, p.slot));
  return views;
}

at::Tensor GeminiManager::slot_view(ChunkId id, size_t slot, Tier tier) {
  return tensor_view(*ctx_, mgr_, TensorHandle{id, slot}, tier);
}

// --- residency -------------------------------------------------------------------------------

void GeminiManager::throw_budget_exceeded(ChunkId id, size_t bytes) {
  int64_t busy = 0, busy_bytes = 0, waiting_bytes = 0, grad_bytes = 0, optim_bytes = 0;
  for (const auto& set : sets_) {
    const Chunk& p = mgr_.chunk(set.spec.param);
    if (p.shard_tiers().contains(Tier::kDevice) && !p.can_move()) {
      busy += 1;
      busy_bytes += static_cast<int64_t>(p.shard_bytes());
    } else if (p.shard_tiers().contains(Tier::kDevice) && p.count_in(S::kReadyForReduce) > 0) {
      waiting_bytes += static_cast<int64_t>(p.shard_bytes());
    }
    if (!set.trainable) continue;
    const Chunk& g = mgr_.chunk(set.spec.grad);
    if (g.shard_tiers().contains(Tier::kDevice)) grad_bytes += static_cast<int64_t>(g.shard_bytes());
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
      grad_bytes, " bytes), optimizer state kept on the device (", optim_bytes,
      " bytes). Raise gpu_memory_limit (GEMINI_EXT_GPU_LIMIT; sim_capacity on the sim device) or use smaller chunks "
      "(chunk_config_dict / min_chunk_size_m)",
      optim_bytes > 0 ? ", or keep more optimizer state on the host (offload_optim_frac closer to 1.0)." : "."));
}

template <typename Fn>
void GeminiManager::with_room_locked(ChunkId id, Fn&& fn) {
  const Chunk& c = mgr_.chunk(id);
  for (;;) {
    // The planning budget first (it may be below what the backend could allocate), then the
    // backend's own limit (OutOfMemoryError from the pool).
    const bool over_budget = !c.shard_tiers().contains(Tier::kDevice) &&
                             mgr_.tier_bytes(Tier::kDevice).current + static_cast<int64_t>(c.shard_bytes()) >
                                 device_budget_locked();
    if (!over_budget) {
      try {
        fn();
        return;
      } catch (const OutOfMemoryError&) {
      }
    }
    if (!make_room_locked(id)) throw_budget_exceeded(id, c.shard_bytes());
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
  if (!victim) return false;
  evict_locked(*victim);
  return true;
}

int64_t GeminiManager::device_budget_locked() const {
  const auto capacity = static_cast<int64_t>(ctx_->backend().device_capacity_bytes());
  return budget_bytes_ > 0 ? std::min(budget_bytes_, capacity) : capacity;
}

void GeminiManager::set_device_budget(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  GX_CHECK(bytes >= 0, "device budget: expected >= 0 bytes (0: the whole device), got ", bytes, ".");
  budget_bytes_ = bytes;
  while (mgr_.tier_bytes(Tier::kDevice).current > device_budget_locked()) {
    if (!make_room_locked(-1)) break;  // what cannot go now goes at the next fetch, or fails there
  }
}

int64_t GeminiManager::device_budget() const {
  return device_budget_locked();
}

void GeminiManager::set_optim_on_host(int set_index, bool on_host) {
  std::lock_guard<std::mutex> lock(mutex_);
  GX_CHECK(set_index >= 0 && static_cast<size_t>(set_index) < sets_.size(), "chunk set index: expected in [0, ",
           sets_.size(), "), got ", set_index, ".");
  GX_CHECK(!in_backward_, "set_optim_on_host during backward: change placement between steps.");
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
          !mgr_.prefetched(set.spec.param))
        evict_locked(set.spec.param);
    }
  }
  with_room_locked(id, [&] { mgr_.access(id); });
  if (!had) {
    counters_.fetches += 1;
    counters_.sync_fetch_waits += 1;
    counters_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    note_locked('F', id);
  }
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

void GeminiManager::prefetch_locked() {
  if (max_prefetch_ <= 0 || !trace_.usable()) return;
  PrefetchQuery q;
  q.max_prefetch = max_prefetch_;
  q.free_bytes = device_budget_locked() - mgr_.tier_bytes(Tier::kDevice).current;
  q.needs_fetch = [&](ChunkId c) {
    return set_of_chunk(c) >= 0 && !mgr_.chunk(c).shard_tiers().contains(Tier::kDevice) && !mgr_.in_flight(c);
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

bool GeminiManager::end_iteration() {
  std::lock_guard<std::mutex> lock(mutex_);
  note_locked('S', -1);
  return trace_.end_iteration();
}

void GeminiManager::allocate_on_device_locked(ChunkId id) {
  with_room_locked(id, [&] { mgr_.allocate_copy(id, Tier::kDevice); });
}

std::vector<ChunkId> GeminiManager::evictable_locked(ChunkId requester) const {
  std::vector<ChunkId> out;
  for (const auto& set : sets_) {
    const Chunk& p = mgr_.chunk(set.spec.param);
    // A parameter chunk may go when it is released or releasable: no tensor in COMPUTE and none
    // waiting for reduction (SPEC: all HOLD / HOLD_AFTER_BWD).
    if (set.spec.param != requester && p.shard_tiers().contains(Tier::kDevice) && p.can_move() &&
        p.count_in(S::kReadyForReduce) == 0 && pinned_.count(set.spec.param) == 0)
      out.push_back(set.spec.param);
    // A gradient chunk on the device that no backward is still writing into (its parameter
    // chunk has no tensor waiting for reduction) can wait for the step on the host.
    if (set.trainable && set.spec.grad != requester && set.grad_place == GradPlace::kDevice &&
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
  if (c.gathered()) mgr_.release(id);
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
  if (c.gathered() && c.can_release()) mgr_.release(id);
}

void GeminiManager::apply_placement() {
  std::lock_guard<std::mutex> lock(mutex_);
  ctx_->sync_compute_stream();
  const Tier host = mgr_.host_tier();
  for (auto& set : sets_) {
    const auto& spec = set.spec;
    const bool device_truth = !set.trainable || !spec.optim_on_host;
    if (set.trainable && !spec.optim_on_host) {
      for (ChunkId id : {spec.master, spec.exp_avg, spec.exp_avg_sq}) {
        if (id < 0) continue;
        with_room_locked(id, [&] { mgr_.move(id, Tier::kDevice); });
      }
      mgr_.discard_copy(spec.grad, host);  // gradients are born on the device and stay there
    }
    if (spec.param_home_on_host) continue;
    if (device_truth) {
      // A frozen chunk or one stepped on the device: its device copy is the truth.
      with_room_locked(spec.param, [&] { mgr_.move(spec.param, Tier::kDevice); });
      lru_.touch(spec.param);
    } else {
      ensure_on_device_locked(spec.param);  // a cache of the permanent host copy
      mgr_.release(spec.param);
    }
  }
  mgr_.backend().synchronize_all();
}

// --- hooks -----------------------------------------------------------------------------------

int GeminiManager::register_module(const std::vector<int>& params) {
  std::lock_guard<std::mutex> lock(mutex_);
  Module m;
  for (int p : params) {
    check_param(p);
    m.params.push_back(p);
    const ChunkId c = params_[static_cast<size_t>(p)].chunk;
    if (std::find(m.chunks.begin(), m.chunks.end(), c) == m.chunks.end()) m.chunks.push_back(c);
  }
  modules_.push_back(std::move(m));
  return static_cast<int>(modules_.size() - 1);
}

namespace {
// The state a fetch for compute leaves a tensor in (see the design note in the header).
void to_compute(ChunkManager& mgr, const ParamSpec& p) {
  const TensorHandle h{p.chunk, p.slot};
  const S s = mgr.state(h);
  if (s == S::kHold || s == S::kHoldAfterBwd) mgr.transition(h, S::kCompute);
}
}  // namespace

void GeminiManager::fetch_for_compute_locked(const Module& m, bool forward) {
  ctx_->sync_compute_stream();
  mgr_.poll();  // reap copies that finished (prefetches stay "in flight" until reaped)
  for (ChunkId c : m.chunks) {
    trace_.record(c);
    ensure_on_device_locked(c);
    // Mark this chunk's tensors before fetching the next chunk, so that fetch cannot evict it.
    for (int p : m.params) {
      const ParamSpec& ps = params_[static_cast<size_t>(p)];
      if (ps.chunk != c) continue;
      to_compute(mgr_, ps);
      if (forward && !in_backward_) forward_refs_[static_cast<size_t>(p)] += 1;
      if (!forward && mgr_.state(TensorHandle{ps.chunk, ps.slot}) == S::kCompute)
        backward_claimed_[static_cast<size_t>(p)] = 1;
    }
  }
  prefetch_locked();
}

void GeminiManager::pre_forward(int module) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_module(module);
  fetch_for_compute_locked(modules_[static_cast<size_t>(module)], /*forward=*/true);
}

void GeminiManager::post_forward(int module) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_module(module);
  const Module& m = modules_[static_cast<size_t>(module)];
  if (in_backward_) {
    // A forward re-run inside backward (activation checkpointing). Tensors a pre-backward hook
    // claimed stay in COMPUTE for that backward; the others are released, and their own
    // pre-backward hook fetches them again when their backward comes.
    for (int p : m.params) {
      const ParamSpec& ps = params_[static_cast<size_t>(p)];
      const TensorHandle h{ps.chunk, ps.slot};
      if (!backward_claimed_[static_cast<size_t>(p)] && mgr_.state(h) == S::kCompute)
        mgr_.transition(h, S::kHoldAfterBwd);
    }
    for (ChunkId c : m.chunks) release_if_idle_locked(c);
    return;
  }
  for (int p : m.params) {
    int& refs = forward_refs_[static_cast<size_t>(p)];
    if (refs > 0) refs -= 1;
    const ParamSpec& ps = params_[static_cast<size_t>(p)];
    const TensorHandle h{ps.chunk, ps.slot};
    if (refs == 0 && mgr_.state(h) == S::kCompute) mgr_.transition(h, S::kHold);
  }
  for (ChunkId c : m.chunks) release_if_idle_locked(c);
}

void GeminiManager::pre_backward(int module) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_module(module);
  in_backward_ = true;
  fetch_for_compute_locked(modules_[static_cast<size_t>(module)], /*forward=*/false);
}

void GeminiManager::post_backward(int module) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_module(module);
  const Module& m = modules_[static_cast<size_t>(module)];
  for (int p : m.params) {
    const ParamSpec& ps = params_[static_cast<size_t>(p)];
    const TensorHandle h{ps.chunk, ps.slot};
    backward_claimed_[static_cast<size_t>(p)] = 0;
    if (mgr_.state(h) == S::kCompute) mgr_.transition(h, S::kHoldAfterBwd);
  }
  for (ChunkId c : m.chunks) release_if_idle_locked(c);
}

void GeminiManager::post_accumulate_grad(int param, at::Tensor& p) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_param(param);
  at::Tensor& grad = p.mutable_grad();
  if (!grad.defined()) return;
  ctx_->sync_compute_stream();
  const ParamSpec& ps = params_[static_cast<size_t>(param)];
  GX_INTERNAL_ASSERT(ps.trainable, "a gradient arrived for frozen parameter ", param);
  ChunkSet& set = sets_[static_cast<size_t>(set_of_chunk(ps.chunk))];
  const ChunkId g = set.spec.grad;
  if (set.grad_place == GradPlace::kNone) {
    allocate_on_device_locked(g);
    shard_view(*ctx_, mgr_, g, Tier::kDevice).zero_();  // slots without a gradient read as 0
    set.grad_place = GradPlace::kDevice;
  }
  Tier tier = Tier::kDevice;
  if (set.grad_place == GradPlace::kHost) {
    mgr_.wait(g);  // a second backward before the step: add to the copy on the host
    tier = mgr_.host_tier();
  }
  at::Tensor slot = slot_view(g, ps.slot, tier);
  GX_CHECK(grad.sizes() == slot.sizes(), "gradient of parameter ", param, ": shape ", grad.sizes().vec().size(),
           "-d does not match the parameter's; a hook replaced it with a tensor of another shape.");
  if (set.has_grad[ps.slot]) {
    slot.add_(grad.to(slot.device(), slot.scalar_type()));
  } else {
    slot.copy_(grad);
  }
  set.has_grad[ps.slot] = 1;
  grad.reset();  // the gradient now lives in its chunk

  const TensorHandle h{ps.chunk, ps.slot};
  backward_claimed_[static_cast<size_t>(param)] = 0;
  if (mgr_.state(h) != S::kReadyForReduce) mgr_.transition(h, S::kReadyForReduce);
  if (!no_sync_ && mgr_.chunk(ps.chunk).can_reduce()) reduce_locked(set);
}

void GeminiManager::reduce_locked(ChunkSet& set) {
  const ChunkId p = set.spec.param;
  mgr_.reduce(p);  // one rank: nothing to communicate; READY_FOR_REDUCE -> HOLD
  set.reduced = true;
  offload_grads_locked(set);
  release_if_idle_locked(p);
}

void GeminiManager::offload_grads_locked(ChunkSet& set) {
  if (!set.spec.optim_on_host || set.grad_place != GradPlace::kDevice) return;
  const ChunkId g = set.spec.grad;
  if (mgr_.chunk(g).shard_tiers().contains(mgr_.host_tier())) mgr_.discard_copy(g, mgr_.host_tier());
  mgr_.move(g, mgr_.host_tier(), async_reduce_);
  set.grad_place = GradPlace::kHost;
  counters_.grad_chunks_offloaded += 1;
}

void GeminiManager::flush_grads() {
  std::lock_guard<std::mutex> lock(mutex_);
  ctx_->sync_compute_stream();
  for (auto& set : sets_)
    if (set.trainable) offload_grads_locked(set);
}

void GeminiManager::end_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  ctx_->sync_compute_stream();
  for (auto& set : sets_) {
    const ChunkId p = set.spec.param;
    const Chunk& c = mgr_.chunk(p);
    for (size_t k = 0; k < c.num_slots(); ++k)
      if (c.slot(k).state == S::kCompute) mgr_.transition(TensorHandle{p, k}, S::kHoldAfterBwd);
    const bool any_grad = std::any_of(set.has_grad.begin(), set.has_grad.end(), [](uint8_t b) { return b != 0; });
    if (set.trainable && !no_sync_ && !set.reduced && any_grad && set.grad_place == GradPlace::kDevice) {
      // Some tensors got no gradient in this backward (unused parameters): flush the chunk with
      // the gradients it has; the optimizer skips the slots without one.
      for (size_t k = 0; k < c.num_slots(); ++k)
        if (c.slot(k).state != S::kReadyForReduce) mgr_.transition(TensorHandle{p, k}, S::kReadyForReduce);
      reduce_locked(set);
      counters_.flushed_chunks += 1;
    }
    for (size_t k = 0; k < c.num_slots(); ++k) {
      const S s = c.slot(k).state;
      if (s == S::kHoldAfterBwd || s == S::kReadyForReduce) mgr_.transition(TensorHandle{p, k}, S::kHold);
    }
    set.reduced = false;
    release_if_idle_locked(p);
  }
  std::fill(forward_refs_.begin(), forward_refs_.end(), 0);
  std::fill(backward_claimed_.begin(), backward_claimed_.end(), 0);
  in_backward_ = false;
  counters_.backward_passes += 1;
}

void GeminiManager::set_no_sync(bool no_sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  no_sync_ = no_sync;
}

// --- gradients and values ----------------------------------------------------------------------

void GeminiManager::zero_grad() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& set : sets_) {
    if (!set.trainable || set.grad_place == GradPlace::kNone) continue;
    std::fill(set.has_grad.begin(), set.has_grad.end(), 0);
    const ChunkId g = set.spec.grad;
    mgr_.wait(g);
    if (mgr_.chunk(g).shard_tiers().contains(Tier::kDevice)) mgr_.discard_copy(g, Tier::kDevice);
    set.grad_place = GradPlace::kNone;
  }
}

void GeminiManager::wait_grads() {
  for (auto& set : sets_)
    if (set.trainable && mgr_.in_flight(set.spec.grad)) mgr_.wait(set.spec.grad);
}

Tier GeminiManager::where_current(ChunkId id) const {
  const Chunk& c = mgr_.chunk(id);
  if (c.shard_tiers().contains(mgr_.host_tier())) return mgr_.host_tier();
  if (c.shard_tiers().contains(Tier::kDevice)) return Tier::kDevice;
  GX_INTERNAL_ASSERT(false, "chunk ", id, " holds no data on any tier");
}

namespace {
ChunkId chunk_of_kind(const ChunkSet& set, const std::string& kind, int param) {
  if (kind == "param") return set.spec.master >= 0 ? set.spec.master : set.spec.param;
  GX_CHECK(kind == "exp_avg" || kind == "exp_avg_sq", "state kind: expected 'param', 'exp_avg' or 'exp_avg_sq', got '",
           kind, "'.");
  GX_CHECK(set.trainable, "parameter ", param, " is frozen (requires_grad=False): it has no optimizer state '", kind,
           "'.");
  return kind == "exp_avg" ? set.spec.exp_avg : set.spec.exp_avg_sq;
}
}  // namespace

at::Tensor GeminiManager::read(const std::string& kind, int param) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_param(param);
  const ParamSpec& ps = params_[static_cast<size_t>(param)];
  const ChunkSet& set = sets_[static_cast<size_t>(set_of_chunk(ps.chunk))];
  const ChunkId id = chunk_of_kind(set, kind, param);
  mgr_.wait(id);
  at::Tensor v = slot_view(id, ps.slot, where_current(id));
  ctx_->sync_compute_stream();
  return v.to(at::TensorOptions().dtype(at::kFloat).device(at::kCPU), /*non_blocking=*/false, /*copy=*/true);
}

void GeminiManager::write(const std::string& kind, int param, const at::Tensor& value) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_param(param);
  const ParamSpec& ps = params_[static_cast<size_t>(param)];
  const ChunkSet& set = sets_[static_cast<size_t>(set_of_chunk(ps.chunk))];
  std::vector<ChunkId> targets{chunk_of_kind(set, kind, param)};
  if (kind == "param" && set.spec.master >= 0) targets.push_back(set.spec.param);  // and its 16-bit copy
  ctx_->sync_compute_stream();
  for (ChunkId id : targets) {
    mgr_.wait(id);
    const Chunk& c = mgr_.chunk(id);
    for (Tier t : {Tier::kDevice, Tier::kPinnedHost, Tier::kPageableHost}) {
      if (!c.shard_tiers().contains(t)) continue;  // every copy, so that they stay coherent
      at::Tensor slot = slot_view(id, ps.slot, t);
      GX_CHECK(value.numel() == slot.numel(), "write of '", kind, "' of parameter ", param, ": expected ",
               slot.numel(), " elements, got ", value.numel(), ".");
      slot.copy_(value.reshape(slot.sizes()));
    }
  }
}

at::Tensor GeminiManager::read_grad(int param) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_param(param);
  const ParamSpec& ps = params_[static_cast<size_t>(param)];
  if (!ps.trainable) return at::Tensor();
  const ChunkSet& set = sets_[static_cast<size_t>(set_of_chunk(ps.chunk))];
  if (!set.has_grad[ps.slot]) return at::Tensor();
  mgr_.wait(set.spec.grad);
  const Tier tier = set.grad_place == GradPlace::kDevice ? Tier::kDevice : mgr_.host_tier();
  ctx_->sync_compute_stream();
  return slot_view(set.spec.grad, ps.slot, tier)
      .to(at::TensorOptions().dtype(at::kFloat).device(at::kCPU), /*non_blocking=*/false, /*copy=*/true);
}

int64_t GeminiManager::step_of(int param) const {
  check_param(param);
  const ParamSpec& ps = params_[static_cast<size_t>(param)];
  return sets_[static_cast<size_t>(set_of_chunk(ps.chunk))].step[ps.slot];
}

void GeminiManager::set_step(int param, int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_param(param);
  GX_CHECK(step >= 0, "step of parameter ", param, ": expected >= 0, got ", step, ".");
  const ParamSpec& ps = params_[static_cast<size_t>(param)];
  sets_[static_cast<size_t>(set_of_chunk(ps.chunk))].step[ps.slot] = step;
}

void GeminiManager::synchronize() {
  ctx_->sync_compute_stream();
  ctx_->backend().synchronize_all();
}

}  // namespace gx::torch_layer
