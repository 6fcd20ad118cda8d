// GeminiManager, part 1: setup and the hook bodies (fetch for compute, release, gradient
// arrival, end of backward). Residency is in gemini_residency.cpp, gradients and values in
// gemini_grads.cpp. See gemini_manager.h for the design.
#include "torch/gemini_manager.h"

#include <algorithm>

#include "core/errors.h"
#include "core/memory_pressure.h"

namespace gx::torch_layer {

using S = TensorState;

GeminiManager::GeminiManager(std::shared_ptr<DeviceContext> ctx, ChunkManager& mgr, std::vector<ChunkSetSpec> specs,
                             std::vector<ParamSpec> params, std::string policy_name)
    : ctx_(std::move(ctx)),
      mgr_(mgr),
      params_(std::move(params)),
      policy_name_(std::move(policy_name)),
      pipeline_([this](int s) { storages_->set_stepping(sets_[static_cast<size_t>(s)].spec.param, false); },
                [this](int s) {
                  return detail::concat("chunk set ", s, " (parameter chunk ", sets_[static_cast<size_t>(s)].spec.param,
                                        ")");
                }),
      residency_(*ctx_, mgr_, sets_, set_of_p_chunk_, trace_, pipeline_, counters_, timeline_, policy_name_) {
  GX_CHECK(mgr_.finalized(), "GeminiManager: the ChunkManager must be finalized first.");
  set_of_p_chunk_.assign(mgr_.num_chunks(), -1);
  for (const auto& spec : specs) {
    ChunkSet set;
    set.spec = spec;
    set.trainable = spec.grad >= 0;
    const Chunk& p = mgr_.chunk(spec.param);
    GX_INTERNAL_ASSERT(set_of_p_chunk_[static_cast<size_t>(spec.param)] < 0, "chunk ", spec.param, " in two sets");
    std::vector<ChunkId> companions = spec.optimizer_chunks();
    companions.push_back(spec.grad);
    for (ChunkId companion : companions)
      if (companion >= 0) check_companion_layout(spec.param, companion);
    GX_INTERNAL_ASSERT(set.trainable || spec.states.empty(), "frozen chunk ", spec.param, " with optimizer state");
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
  const at::Device dev = ctx_->device_for(Tier::kDevice);
  refresh_forward_order_locked();  // index order until an iteration is recorded
  reclaimer_id_ = MemoryPressure::instance().add_reclaimer(dev.is_cuda() ? dev.index() : -1,
                                                           [this](size_t bytes) { return reclaim_device_bytes(bytes); });
}

void GeminiManager::check_companion_layout(ChunkId param, ChunkId companion) const {
  const Chunk& p = mgr_.chunk(param);
  const Chunk& c = mgr_.chunk(companion);
  GX_INTERNAL_ASSERT(c.num_slots() == p.num_slots() && c.padded_numel() == p.padded_numel(), "chunk ", companion,
                     " does not share the layout of parameter chunk ", param);
  for (size_t k = 0; k < p.num_slots(); ++k)
    GX_INTERNAL_ASSERT(c.slot(k).offset_numel == p.slot(k).offset_numel, "slot ", k, " of chunk ", companion,
                       " is not at the offset of its parameter");
}

void GeminiManager::stop_reclaiming() {
  MemoryPressure::instance().remove_reclaimer(reclaimer_id_);
}

GeminiManager::~GeminiManager() {
  MemoryPressure::instance().remove_reclaimer(reclaimer_id_);
  try {
    optimizer_.reset();  // its speculative steps are settled and its spares freed
  } catch (...) {
  }
  // CPU steps still running write chunk memory: they finish before anything is freed.
  pipeline_.drain();
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

void GeminiManager::check_set(int set_index) const {
  GX_CHECK(set_index >= 0 && static_cast<size_t>(set_index) < sets_.size(), "chunk set index: expected in [0, ",
           sets_.size(), "), got ", set_index, ".");
}

void GeminiManager::check_module(int module) const {
  GX_CHECK(module >= 0 && static_cast<size_t>(module) < modules_.size(), "module index: expected in [0, ",
           modules_.size(), "), got ", module, ".");
}

std::vector<at::Tensor> GeminiManager::param_views() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  std::vector<at::Tensor> views;
  views.reserve(params_.size());
  for (const auto& p : params_) views.push_back(storages_->view(p.chunk, p.slot));
  return views;
}

std::string GeminiManager::param_binding(int param) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  check_param(param);
  switch (storages_->binding(params_[static_cast<size_t>(param)].chunk)) {
    case StorageBinding::kDevice: return "device";
    case StorageBinding::kHost: return "host";
    case StorageBinding::kNone: return "none";
  }
  GX_INTERNAL_ASSERT(false, "unknown storage binding");
}

at::Tensor GeminiManager::slot_view(ChunkId id, size_t slot, Tier tier) {
  return tensor_view(*ctx_, mgr_, TensorHandle{id, slot}, tier);
}

bool GeminiManager::end_iteration() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  move_phase(HookEvent::kEndIteration);
  note_locked('S', -1);
  const bool repeated = trace_.end_iteration();
  refresh_forward_order_locked();
  return repeated;
}

void GeminiManager::apply_placement() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  settle_all_locked();
  ctx_->sync_compute_stream();
  const Tier host = mgr_.host_tier();
  for (auto& set : sets_) {
    const auto& spec = set.spec;
    const bool device_truth = !set.trainable || !spec.optim_on_host;
    if (set.trainable && !spec.optim_on_host) {
      for (ChunkId id : spec.optimizer_chunks()) {
        residency_.with_room(id, [&] { mgr_.move(id, Tier::kDevice); });
      }
      // Gradients are born on the device in backward and stay there: until then the chunk holds
      // no copy (the engine creates it without one; a first copy elsewhere carries nothing).
      for (Tier t : {host, Tier::kDevice}) {
        if (mgr_.chunk(spec.grad).shard_tiers().contains(t)) mgr_.discard_copy(spec.grad, t);
      }
    }
    if (spec.param_home_on_host) continue;
    if (device_truth) {
      // A frozen chunk or one stepped on the device: its device copy is the truth.
      residency_.with_room(spec.param, [&] { mgr_.move(spec.param, Tier::kDevice); });
      residency_.touch(spec.param);
    } else if (sharded()) {
      residency_.ensure_shard_on_device(spec.param);  // a cache of the permanent host copy
    } else {
      residency_.ensure_on_device(spec.param);  // a cache of the permanent host copy
      mgr_.release(spec.param);
    }
  }
  mgr_.backend().synchronize_all();
}

// --- hooks -----------------------------------------------------------------------------------

int GeminiManager::register_module(const std::vector<int>& params) {
  std::lock_guard<OwnedMutex> lock(mutex_);
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

void GeminiManager::watch_params(std::vector<at::Tensor> params) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  GX_INTERNAL_ASSERT(params.empty() || params.size() == params_.size(), "watch_params: ", params.size(),
                     " tensors for ", params_.size(), " parameters");
  watched_ = std::move(params);
  watched_versions_.assign(watched_.size(), 0);
  for (size_t i = 0; i < watched_.size(); ++i) watched_versions_[i] = watched_[i]._version();
}

std::vector<int> GeminiManager::written_params() const {
  std::vector<int> out;
  for (size_t i = 0; i < watched_.size(); ++i)
    if (watched_[i]._version() != watched_versions_[i]) out.push_back(static_cast<int>(i));
  return out;
}

void GeminiManager::note_param_versions() {
  for (size_t i = 0; i < watched_.size(); ++i) watched_versions_[i] = watched_[i]._version();
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
    if (const int s = set_of_chunk(c); s >= 0) settle_locked(s);  // its CPU step, if still running
    residency_.ensure_on_device(c);
    // Mark this chunk's tensors before fetching the next chunk, so that fetch cannot evict it.
    for (int p : m.params) {
      const ParamSpec& ps = params_[static_cast<size_t>(p)];
      if (ps.chunk != c) continue;
      to_compute(mgr_, ps);
      if (forward && !in_backward()) forward_refs_[static_cast<size_t>(p)] += 1;
      if (!forward && mgr_.state(TensorHandle{ps.chunk, ps.slot}) == S::kCompute)
        backward_claimed_[static_cast<size_t>(p)] = 1;
    }
  }
  residency_.prefetch();
}

void GeminiManager::pre_forward(int module) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  check_module(module);
  move_phase(HookEvent::kPreForward);
  fetch_for_compute_locked(modules_[static_cast<size_t>(module)], /*forward=*/true);
}

void GeminiManager::post_forward(int module) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  check_module(module);
  const Module& m = modules_[static_cast<size_t>(module)];
  move_phase(HookEvent::kPostForward);
  if (in_backward()) {
    // A forward re-run inside backward (activation checkpointing). Tensors a pre-backward hook
    // claimed stay in COMPUTE for that backward; the others are released, and their own
    // pre-backward hook fetches them again when their backward comes.
    for (int p : m.params) {
      const ParamSpec& ps = params_[static_cast<size_t>(p)];
      const TensorHandle h{ps.chunk, ps.slot};
      if (!backward_claimed_[static_cast<size_t>(p)] && mgr_.state(h) == S::kCompute)
        mgr_.transition(h, S::kHoldAfterBwd);
    }
    for (ChunkId c : m.chunks) residency_.release_if_idle(c);
    return;
  }
  for (int p : m.params) {
    int& refs = forward_refs_[static_cast<size_t>(p)];
    if (refs > 0) refs -= 1;
    const ParamSpec& ps = params_[static_cast<size_t>(p)];
    const TensorHandle h{ps.chunk, ps.slot};
    if (refs == 0 && mgr_.state(h) == S::kCompute) mgr_.transition(h, S::kHold);
  }
  for (ChunkId c : m.chunks) residency_.release_if_idle(c);
}

void GeminiManager::pre_backward(int module) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  check_module(module);
  move_phase(HookEvent::kPreBackward);
  fetch_for_compute_locked(modules_[static_cast<size_t>(module)], /*forward=*/false);
}

void GeminiManager::post_backward(int module) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  check_module(module);
  move_phase(HookEvent::kPostBackward);
  const Module& m = modules_[static_cast<size_t>(module)];
  for (int p : m.params) {
    const ParamSpec& ps = params_[static_cast<size_t>(p)];
    const TensorHandle h{ps.chunk, ps.slot};
    backward_claimed_[static_cast<size_t>(p)] = 0;
    if (mgr_.state(h) == S::kCompute) mgr_.transition(h, S::kHoldAfterBwd);
  }
  for (ChunkId c : m.chunks) residency_.release_if_idle(c);
}

void GeminiManager::post_accumulate_grad(int param, at::Tensor& p) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  check_param(param);
  at::Tensor& grad = p.mutable_grad();
  if (!grad.defined()) return;
  move_phase(HookEvent::kGradArrived);
  ctx_->sync_compute_stream();
  const ParamSpec& ps = params_[static_cast<size_t>(param)];
  GX_INTERNAL_ASSERT(ps.trainable, "a gradient arrived for frozen parameter ", param);
  const int set_index = set_of_chunk(ps.chunk);
  settle_locked(set_index);  // its G may still be read by the last step's CPU Adam
  ChunkSet& set = sets_[static_cast<size_t>(set_index)];
  const ChunkId g = set.spec.grad;
  drop_whole_cache_locked();
  set.grad_sq = at::Tensor();  // G changes
  at::Tensor slot;
  bool accumulate = set.has_grad[ps.slot] != 0;
  if (sharded()) {
    // Every rank holds whole gradients until the chunk is reduced: a gathered G buffer.
    if (!set.grad_collecting) {
      residency_.with_room(g, [&] { mgr_.allocate_gathered(g); }, static_cast<int64_t>(mgr_.chunk(g).chunk_bytes()));
      gathered_chunk_view(*ctx_, mgr_, g).zero_();  // slots without a gradient, padding and gaps read as 0
      set.grad_collecting = true;
      accumulate = false;  // gradients reduced earlier are added when this buffer is reduced
    }
    slot = gathered_view(*ctx_, mgr_, TensorHandle{g, ps.slot});
  } else {
    if (set.grad_place == GradPlace::kNone) {
      residency_.allocate_on_device(g);
      shard_view(*ctx_, mgr_, g, Tier::kDevice).zero_();  // slots without a gradient read as 0
      set.grad_place = GradPlace::kDevice;
    }
    Tier tier = Tier::kDevice;
    if (set.grad_place == GradPlace::kHost) {
      mgr_.wait(g);  // a second backward before the step: add to the copy on the host
      tier = mgr_.host_tier();
    }
    slot = slot_view(g, ps.slot, tier);
  }
  GX_CHECK(grad.sizes() == slot.sizes(), "gradient of parameter ", param, ": ", grad.numel(), " elements in ",
           grad.dim(), " dims, the parameter has ", slot.numel(), " in ", slot.dim(),
           "; a hook replaced the gradient with a tensor of another shape.");
  if (accumulate) {
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

void GeminiManager::end_backward() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  ctx_->sync_compute_stream();
  drop_whole_cache_locked();
  for (auto& set : sets_) {
    const ChunkId p = set.spec.param;
    const Chunk& c = mgr_.chunk(p);
    for (size_t k = 0; k < c.num_slots(); ++k)
      if (c.slot(k).state == S::kCompute) mgr_.transition(TensorHandle{p, k}, S::kHoldAfterBwd);
    const bool any_grad = std::any_of(set.has_grad.begin(), set.has_grad.end(), [](uint8_t b) { return b != 0; });
    const bool unreduced = sharded() ? set.grad_collecting : set.grad_place == GradPlace::kDevice;
    if (set.trainable && !no_sync_ && !set.reduced && any_grad && unreduced) {
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
    residency_.release_if_idle(p);
    ungather_kept_locked(set);  // kept gathered through backward, which is over
  }
  std::fill(forward_refs_.begin(), forward_refs_.end(), 0);
  std::fill(backward_claimed_.begin(), backward_claimed_.end(), 0);
  move_phase(HookEvent::kEndBackward);
  counters_.backward_passes += 1;
}

void GeminiManager::set_no_sync(bool no_sync) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  no_sync_ = no_sync;
}


}  // namespace gx::torch_layer
