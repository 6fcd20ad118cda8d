// GeminiManager, values: fp32 CPU copies of parameters, masters, optimizer states and
// gradients for state dicts, checkpoints and close; writes into every copy; step counts; the
// trace, counters and synchronisation. Sharded reads all-gather the chunk (collective). See
// manager.h.
#include <ATen/ops/empty.h>

#include "core/errors.h"
#include "torch/manager/manager.h"

namespace gx::torch_layer {

namespace {
// An fp32 copy on the CPU (the form state dicts and checkpoints use); blocks until it is there.
at::Tensor cpu_fp32_copy(const at::Tensor& view) {
  return view.to(at::TensorOptions().dtype(at::kFloat).device(at::kCPU), /*non_blocking=*/false, /*copy=*/true);
}
}  // namespace

namespace {
ChunkId chunk_of_kind(const ChunkSet& set, StateKind kind, int param) {
  if (kind == StateKind::kParam) return set.spec.master >= 0 ? set.spec.master : set.spec.param;
  GX_CHECK(set.trainable, "parameter ", param, " is frozen (requires_grad=False): it has no optimizer state '",
           state_kind_name(kind), "'.");
  const ChunkId id = set.spec.state(kind);
  GX_CHECK(id >= 0, "parameter ", param, " has no optimizer state '", state_kind_name(kind),
           "': the optimizer rule does not keep it.");
  return id;
}
}  // namespace

TensorHandle GeminiManager::value_handle_locked(StateKind kind, int param) {
  check_param(param);
  const ParamSpec& ps = params_[static_cast<size_t>(param)];
  const ChunkSet& set = sets_[static_cast<size_t>(set_of_chunk(ps.chunk))];
  const ChunkId id = chunk_of_kind(set, kind, param);
  // see [Note: reading a guessed set] (torch/optim/hybrid_optimizer_in_place.cpp)
  const std::set<int> kept = optimizer_ ? optimizer_->wait_guesses_for_read() : std::set<int>{};
  for (int s : std::vector<int>(pipeline_.pending_sets().begin(), pipeline_.pending_sets().end()))
    if (kept.count(s) == 0) settle_locked(s);
  mgr_.wait(id);
  ctx_->sync_compute_stream();
  return TensorHandle{id, ps.slot};
}

at::Tensor GeminiManager::before_guess_locked(int param, const TensorHandle& h, Tier tier, at::Tensor copy) {
  // P's device copy is refreshed only once the guess is judged: read there, it is the value before.
  if (optimizer_ && tier != Tier::kDevice) {
    const int set = set_of_chunk(params_[static_cast<size_t>(param)].chunk);
    optimizer_->read_before_guess(set, h.chunk_id, h.slot_index, copy);
  }
  return copy;
}

at::Tensor GeminiManager::read(StateKind kind, int param) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  const TensorHandle h = value_handle_locked(kind, param);
  const Tier tier = residency_.where_current(h.chunk_id);
  return before_guess_locked(param, h, tier, cpu_fp32_copy(value_view_locked(h.chunk_id, h.slot_index, tier)));
}

at::Tensor GeminiManager::read_to(StateKind kind, int param, at::Device device, at::ScalarType dtype) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  const TensorHandle h = value_handle_locked(kind, param);
  const Tier tier = residency_.where_current(h.chunk_id);
  return before_guess_locked(param, h, tier,
                             value_view_locked(h.chunk_id, h.slot_index, tier)
                                 .to(at::TensorOptions().dtype(dtype).device(device), /*non_blocking=*/false,
                                     /*copy=*/true));
}

at::Tensor GeminiManager::read_compute_param_to(int param, at::Device device, at::ScalarType dtype) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  value_handle_locked(StateKind::kParam, param);  // settles the steps and waits for the chunk's copies
  const ParamSpec& ps = params_[static_cast<size_t>(param)];
  mgr_.wait(ps.chunk);
  // Every copy present holds the same bytes: unsharded, a device copy is read where it is (a copy
  // on the device's own memory, not over the link from the host's).
  const bool on_device = !sharded() && mgr_.chunk(ps.chunk).shard_tiers().contains(Tier::kDevice);
  const Tier tier = on_device ? Tier::kDevice : residency_.where_current(ps.chunk);
  return before_guess_locked(param, TensorHandle{ps.chunk, ps.slot}, tier,
                             value_view_locked(ps.chunk, ps.slot, tier)
                                 .to(at::TensorOptions().dtype(dtype).device(device), /*non_blocking=*/false,
                                     /*copy=*/true));
}

bool GeminiManager::take_read_before_guess_note() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  if (read_before_guess_noted_ || !optimizer_ || optimizer_->reads_before_guesses() == 0) return false;
  read_before_guess_noted_ = true;
  return true;
}

void GeminiManager::release_read_cache() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  drop_whole_cache_locked();
}

std::tuple<int64_t, int64_t, at::Tensor> GeminiManager::read_local(StateKind kind, int param) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  const TensorHandle h = value_handle_locked(kind, param);
  const ChunkId id = h.chunk_id;
  const SlotPart part = slot_part_in_shard(mgr_, h);
  if (part.begin == part.end) return {0, 0, at::empty({0}, at::kFloat)};
  const Tier tier = residency_.where_current(id);
  at::Tensor shard = shard_view(*ctx_, mgr_, id, tier);
  at::Tensor copy = cpu_fp32_copy(shard.narrow(0, part.shard_offset, part.end - part.begin));
  if (!sharded()) copy = before_guess_locked(param, h, tier, copy);  // the whole slot: one rank
  return {part.begin, part.end, copy};
}

at::Tensor GeminiManager::value_view_locked(ChunkId id, size_t slot, Tier tier) {
  return sharded() ? whole_slot_locked(id, slot, tier) : slot_view(id, slot, tier);
}

at::Tensor GeminiManager::whole_slot_locked(ChunkId id, size_t slot, Tier tier) {
  if (whole_cache_id_ != id) {
    // All ranks read the same chunks in the same order (state dicts, checkpoints, close), so
    // this all-gather is collective like the hooks' ones. The gathered chunk stays on the
    // device in its own dtype: each reader copies its slot where it wants it (a CPU fp32 copy,
    // or straight to a GPU at close) and releases the cache when done.
    drop_whole_cache_locked();  // the previous chunk's memory goes back before this one's is taken
    const Chunk& c = mgr_.chunk(id);
    const at::Device device = ctx_->device_for(Tier::kDevice);
    at::Tensor shard = shard_view(*ctx_, mgr_, id, tier).to(device, /*non_blocking=*/false, /*copy=*/true);
    at::Tensor whole = at::empty({c.padded_numel()}, shard.options());
    mgr_.communicator()->all_gather(shard.data_ptr(), whole.data_ptr(), c.shard_numel(), c.dtype(),
                                    StreamKind::kCompute);
    whole_cache_ = whole;
    whole_cache_id_ = id;
  }
  const TensorSlot& s = mgr_.chunk(id).slot(slot);
  return whole_cache_.narrow(0, s.offset_numel, s.numel).view(s.shape);
}

void GeminiManager::write(StateKind kind, int param, const at::Tensor& value) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  settle_all_locked();
  check_param(param);
  const ParamSpec& ps = params_[static_cast<size_t>(param)];
  const ChunkSet& set = sets_[static_cast<size_t>(set_of_chunk(ps.chunk))];
  std::vector<ChunkId> targets{chunk_of_kind(set, kind, param)};
  if (kind == StateKind::kParam && set.spec.master >= 0) targets.push_back(set.spec.param);  // and its 16-bit copy
  ctx_->sync_compute_stream();
  drop_whole_cache_locked();
  const int64_t numel = mgr_.chunk(ps.chunk).slot(ps.slot).numel;
  GX_CHECK(value.numel() == numel, "write of '", state_kind_name(kind), "' of parameter ", param, ": expected ", numel,
           " elements, got ", value.numel(), ".");
  for (ChunkId id : targets) {
    mgr_.wait(id);
    const Chunk& c = mgr_.chunk(id);
    if (sharded() && c.gathered() && c.can_move()) mgr_.ungather(id);  // gathered again, with the new value
    for (Tier t : {Tier::kDevice, Tier::kPinnedHost, Tier::kPageableHost}) {
      if (!c.shard_tiers().contains(t)) continue;  // every copy, so that they stay coherent
      write_slot_part(*ctx_, mgr_, TensorHandle{id, ps.slot}, t, value);  // this rank's part of it
    }
  }
}

at::Tensor GeminiManager::read_grad(int param) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  settle_all_locked();
  check_param(param);
  const ParamSpec& ps = params_[static_cast<size_t>(param)];
  if (!ps.trainable) return at::Tensor();
  const ChunkSet& set = sets_[static_cast<size_t>(set_of_chunk(ps.chunk))];
  if (!set.has_grad[ps.slot]) return at::Tensor();
  mgr_.wait(set.spec.grad);
  ctx_->sync_compute_stream();
  if (sharded() && set.grad_collecting)  // not reduced yet (no_sync): this rank's own gradient
    return cpu_fp32_copy(gathered_view(*ctx_, mgr_, TensorHandle{set.spec.grad, ps.slot}));
  const Tier tier = set.grad_place == GradPlace::kDevice ? Tier::kDevice : mgr_.host_tier();
  return cpu_fp32_copy(value_view_locked(set.spec.grad, ps.slot, tier));
}

int64_t GeminiManager::step_of(int param) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  check_param(param);
  const ParamSpec& ps = params_[static_cast<size_t>(param)];
  return sets_[static_cast<size_t>(set_of_chunk(ps.chunk))].step[ps.slot];
}

void GeminiManager::set_step(int param, int64_t step) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  check_param(param);
  GX_CHECK(step >= 0, "step of parameter ", param, ": expected >= 0, got ", step, ".");
  const ParamSpec& ps = params_[static_cast<size_t>(param)];
  sets_[static_cast<size_t>(set_of_chunk(ps.chunk))].step[ps.slot] = step;
}

std::tuple<std::vector<ChunkId>, int64_t, int64_t, bool> GeminiManager::trace_info() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  return {trace_.recorded(), trace_.iterations(), trace_.rerecordings(), trace_.usable()};
}

bool GeminiManager::trace_diverged() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  return trace_.diverged();
}

EngineCounters GeminiManager::counters() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  return counters_locked();
}

EngineCounters GeminiManager::counters_locked() const {
  EngineCounters c = counters_;
  const ResidencyCounters& r = residency_.counters();
  c.fetches = r.fetches;
  c.sync_fetch_waits = r.sync_fetch_waits;
  c.wait_seconds = r.wait_seconds;
  c.evictions = r.evictions;
  c.evicted_bytes = r.evicted_bytes;
  c.optimizer_wait_seconds = pipeline_.wait_seconds();
  c.optimizer_waits = pipeline_.waits();
  return c;
}

void GeminiManager::synchronize() {
  settle_all();
  ctx_->sync_compute_stream();
  ctx_->backend().synchronize_all();
}

}  // namespace gx::torch_layer
