// GeminiManager, the hook bodies: fetch for compute, release after forward and backward, and
// the end of backward (tensors back to HOLD, chunks without every gradient flushed). Gradient
// arrival is manager_grads.cpp. See manager.h for the lifecycle of a parameter tensor.
#include <algorithm>

#include "core/errors.h"
#include "torch/manager/manager.h"

namespace gx::torch_layer {

using S = TensorState;

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
    residency_.ungather_kept(set);  // kept gathered through backward, which is over
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
