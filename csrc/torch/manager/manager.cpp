// GeminiManager: construction, parameter views and bindings, the initial placement, modules and
// the parameters' version counters, and the iteration end. See manager.h for the design and
// the other rooms.
#include "torch/manager/manager.h"

#include <algorithm>
#include <utility>

#include "core/errors.h"
#include "core/memory_pressure.h"
#include "torch/profiler_ranges.h"

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
      residency_(ctx_->backend(), mgr_, sets_, set_of_p_chunk_, trace_, pipeline_, timeline_, policy_name_) {
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
  grad_sq_.assign(sets_.size(), at::Tensor());
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
  mgr_.set_trace_ranges(profiler_ranges());
  pipeline_.set_trace_ranges(profiler_ranges());
  const at::Device dev = ctx_->device_for(Tier::kDevice);
  refresh_forward_order_locked();  // index order until an iteration is recorded
  reclaimer_id_ = MemoryPressure::instance().add_reclaimer(
      dev.is_cuda() ? dev.index() : -1, [this](size_t bytes) { return reclaim_device_bytes(bytes); });
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

IterationEnd GeminiManager::end_iteration() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  move_phase(HookEvent::kEndIteration);
  note_locked('S', -1);
  IterationEnd out;
  out.repeated = trace_.end_iteration();
  refresh_forward_order_locked();
  out.counters = counters_locked();
  out.device_bytes_peak = timeline_.last_iteration_peak_bytes();
  out.trace_rerecordings = trace_.rerecordings();
  return out;
}

void GeminiManager::begin_generation_trace() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  GX_INTERNAL_ASSERT(!generating_, "begin_generation_trace while generating");
  std::swap(trace_, set_aside_trace_);  // residency_ reads trace_: it now follows generation's
  generating_ = true;
}

void GeminiManager::end_generation_pass() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  if (generating_ && trace_.position() > 0) trace_.end_iteration();
}

void GeminiManager::end_generation_trace() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  if (!generating_) return;
  if (trace_.position() > 0) trace_.end_iteration();
  std::swap(trace_, set_aside_trace_);
  generating_ = false;
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
        residency_.with_space_for(id, [&] { mgr_.move(id, Tier::kDevice); });
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
      residency_.with_space_for(spec.param, [&] { mgr_.move(spec.param, Tier::kDevice); });
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
  watched_storages_.assign(watched_.size(), nullptr);
  for (size_t i = 0; i < watched_.size(); ++i)
    if (watched_[i].has_storage()) watched_storages_[i] = watched_[i].storage().unsafeGetStorageImpl();
}

std::vector<int> GeminiManager::rebound_params() const {
  std::vector<int> out;
  for (size_t i = 0; i < watched_.size(); ++i) {
    const c10::StorageImpl* now = watched_[i].has_storage() ? watched_[i].storage().unsafeGetStorageImpl() : nullptr;
    if (now != watched_storages_[i]) out.push_back(static_cast<int>(i));
  }
  return out;
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

}  // namespace gx::torch_layer
