// GeminiManager, gradients: arrival (post-accumulate-grad copies p.grad into its G slot),
// reduction (sharded: reduce-scatter, replicas summed), offload to the optimizer's tier, flush
// and zero_grad. See manager.h.
#include <ATen/ops/linalg_vector_norm.h>

#include "core/errors.h"
#include "torch/manager/manager.h"

namespace gx::torch_layer {

using S = TensorState;

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
  grad_sq_[static_cast<size_t>(set_index)] = at::Tensor();  // G changes
  at::Tensor slot;
  bool accumulate = set.has_grad[ps.slot] != 0;
  if (sharded()) {
    // Every rank holds whole gradients until the chunk is reduced: a gathered G buffer.
    if (!set.grad_collecting) {
      residency_.with_space_for(g, [&] { mgr_.allocate_gathered(g); },
                                static_cast<int64_t>(mgr_.chunk(g).chunk_bytes()));
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

void GeminiManager::reduce_locked(ChunkSet& set) {
  const ChunkId p = set.spec.param;
  settle_locked(set_of_chunk(p));  // the last step's CPU Adam may still read G's host copy
  if (sharded()) communicate_grads_locked(set);
  mgr_.reduce(p);  // READY_FOR_REDUCE -> HOLD
  set.reduced = true;
  offload_grads_locked(set);
  // Its gradients are complete for this backward: on the host (moved now, or accumulated there by
  // a second backward), its step may start now.
  if (optimizer_ && set.grad_place == GradPlace::kHost) optimizer_->speculate(set_of_chunk(p));
  residency_.release_if_idle(p);
  residency_.ungather_kept(set);  // its backward is over: the gradients of every tensor are in
}

void GeminiManager::communicate_grads_locked(ChunkSet& set) {
  if (!set.grad_collecting) return;
  const int set_index = set_of_chunk(set.spec.param);
  settle_locked(set_index);  // a pending step may still read G's host copy
  grad_sq_[static_cast<size_t>(set_index)] = at::Tensor();
  const ChunkId g = set.spec.grad;
  drop_whole_cache_locked();
  const int world = mgr_.world_size() * (replicas_ != nullptr ? replicas_->world_size() : 1);
  // Pre-division: the sum over ranks is then the mean, and 16-bit sums stay in range.
  if (world > 1) gathered_chunk_view(*ctx_, mgr_, g).div_(static_cast<double>(world));
  // Gradients reduced in an earlier backward of this step (no zero_grad in between) are added.
  at::Tensor earlier;
  if (set.grad_place == GradPlace::kDevice) {
    earlier = shard_view(*ctx_, mgr_, g, Tier::kDevice).clone();
  }
  residency_.with_space_for(g, [&] { mgr_.reduce_scatter(g); });
  set.grad_collecting = false;
  at::Tensor reduced = shard_view(*ctx_, mgr_, g, Tier::kDevice);
  if (replicas_ != nullptr && replicas_->world_size() > 1) {
    const Chunk& c = mgr_.chunk(g);
    replicas_->all_reduce(reduced.data_ptr(), c.shard_numel(), c.dtype(), ReduceOp::kSum, StreamKind::kCompute);
  }
  if (earlier.defined()) {
    reduced.add_(earlier);
  } else if (set.grad_place == GradPlace::kHost) {
    mgr_.wait(g);
    at::Tensor host = shard_view(*ctx_, mgr_, g, mgr_.host_tier());
    host.add_(reduced.to(host.device()));
    mgr_.discard_copy(g, Tier::kDevice);
    return;  // the sum is on the host, where it was
  }
  set.grad_place = GradPlace::kDevice;
}

void GeminiManager::offload_grads_locked(ChunkSet& set) {
  if (!set.spec.optim_on_host || set.grad_place != GradPlace::kDevice) return;
  const int set_index = set_of_chunk(set.spec.param);
  settle_locked(set_index);  // a pending step may still read G's host copy
  const ChunkId g = set.spec.grad;
  // The norm is taken here, on the device, while G is complete there: the step then needs no
  // pass over the host copies for clipping or the fp16 overflow check.
  grad_sq_[static_cast<size_t>(set_index)] =
      at::linalg_vector_norm(shard_view(*ctx_, mgr_, g, Tier::kDevice), 2, std::nullopt, false, at::kFloat).square();
  if (mgr_.chunk(g).shard_tiers().contains(mgr_.host_tier())) mgr_.discard_copy(g, mgr_.host_tier());
  mgr_.move(g, mgr_.host_tier(), async_reduce_);
  set.grad_place = GradPlace::kHost;
  counters_.grad_chunks_offloaded += 1;
}

void GeminiManager::flush_grads() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  flush_grads_locked();
}

void GeminiManager::flush_grads_locked() {
  if (optimizer_) optimizer_->gradients_complete();  // what the flush moves to the host steps at step()
  ctx_->sync_compute_stream();
  for (auto& set : sets_) {
    if (!set.trainable) continue;
    if (sharded()) communicate_grads_locked(set);  // accumulated under no_sync
    offload_grads_locked(set);
  }
}

void GeminiManager::zero_grad() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  if (optimizer_) optimizer_->grads_cleared();  // steps taken in place on these gradients are undone
  drop_whole_cache_locked();
  for (auto& set : sets_) {
    if (!set.trainable) continue;
    const ChunkId g = set.spec.grad;
    std::fill(set.has_grad.begin(), set.has_grad.end(), 0);
    grad_sq_[static_cast<size_t>(set_of_chunk(set.spec.param))] = at::Tensor();
    if (set.grad_collecting) {
      mgr_.ungather(g);
      set.grad_collecting = false;
    }
    if (set.grad_place == GradPlace::kNone) continue;
    mgr_.wait(g);
    if (mgr_.chunk(g).shard_tiers().contains(Tier::kDevice)) mgr_.discard_copy(g, Tier::kDevice);
    set.grad_place = GradPlace::kNone;
  }
}

bool GeminiManager::has_grad(int param) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  check_param(param);
  const ParamSpec& ps = params_[static_cast<size_t>(param)];
  return sets_[static_cast<size_t>(set_of_chunk(ps.chunk))].has_grad[ps.slot] != 0;
}

void GeminiManager::set_replica_communicator(Communicator* replicas) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  GX_CHECK(sharded(), "set_replica_communicator: the chunks are not sharded; HSDP needs a ZeRO group as well.");
  replicas_ = replicas;
}

}  // namespace gx::torch_layer
