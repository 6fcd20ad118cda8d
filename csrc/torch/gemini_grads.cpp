// GeminiManager, part 3: gradients and values. Reducing and offloading gradient chunks,
// zero_grad, and reading / writing masters, moments and step counts for state dicts and
// checkpoints. See gemini_manager.h.
#include "core/errors.h"
#include "torch/dtype_map.h"
#include "torch/gemini_manager.h"

namespace gx::torch_layer {

using S = TensorState;

namespace {
// An fp32 copy on the CPU (the form state dicts and checkpoints use); blocks until it is there.
at::Tensor cpu_fp32_copy(const at::Tensor& view) {
  return view.to(at::TensorOptions().dtype(at::kFloat).device(at::kCPU), /*non_blocking=*/false, /*copy=*/true);
}
}  // namespace

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
  return cpu_fp32_copy(v);
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
  return cpu_fp32_copy(slot_view(set.spec.grad, ps.slot, tier));
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
