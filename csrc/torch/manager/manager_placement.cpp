// GeminiManager, residency and placement entry points: the budget, memory-pressure reclaim,
// moving a set's optimizer state between tiers, the placements and the timeline. The work is the
// Residency room's (core/residency.h). See manager.h.
#include "core/errors.h"
#include "torch/manager/manager.h"

namespace gx::torch_layer {

void GeminiManager::set_device_budget(int64_t bytes) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  settle_all_locked();
  residency_.set_budget(bytes);
}

int GeminiManager::prefetch_next_forward() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  return residency_.prefetch_next_forward();
}

bool GeminiManager::hold_params_on_device() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  GX_CHECK(!in_backward(), "hold_params_on_device during backward: generation runs between steps.");
  return residency_.hold_params();
}

void GeminiManager::release_params_on_device() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  residency_.release_params();
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
  while (released < bytes && residency_.evict_once(-1)) released += mgr_.trim(Tier::kDevice);
  counters_.reclaims += 1;
  counters_.reclaimed_bytes += before - mgr_.tier_bytes(Tier::kDevice).current;
  return released;
}

int64_t GeminiManager::device_budget() const { return residency_.budget(); }

void GeminiManager::set_optim_on_host(int set_index, bool on_host) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  check_set(set_index);
  GX_CHECK(!in_backward(), "set_optim_on_host during backward: change placement between steps.");
  settle_all_locked();
  ChunkSet& set = sets_[static_cast<size_t>(set_index)];
  GX_CHECK(set.trainable, "chunk set ", set_index, " holds frozen parameters: it has no optimizer state to place.");
  if (set.spec.optim_on_host == on_host) return;
  ctx_->sync_compute_stream();
  const Tier host = mgr_.host_tier();
  const Tier to = on_host ? host : Tier::kDevice;
  for (ChunkId id : set.spec.optimizer_chunks()) {
    if (to == Tier::kDevice) {
      residency_.with_space_for(id, [&] { mgr_.move(id, to); });
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

void GeminiManager::set_param_home_on_host(int set_index, bool on_host) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  check_set(set_index);
  ChunkSet& set = sets_[static_cast<size_t>(set_index)];
  GX_INTERNAL_ASSERT(!on_host || (set.trainable && set.spec.optim_on_host &&
                                  mgr_.chunk(set.spec.param).shard_tiers().contains(mgr_.host_tier())),
                     "set_param_home_on_host: chunk set ", set_index, " has no permanent host copy of its parameters");
  set.spec.param_home_on_host = on_host;
}

std::vector<TimelineEvent> GeminiManager::timeline() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  return timeline_.events();
}

std::vector<SetPlacement> GeminiManager::set_placements() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  std::vector<SetPlacement> out;
  for (const auto& s : sets_)
    out.push_back(SetPlacement{s.spec.param, s.trainable, s.spec.optim_on_host, s.spec.param_home_on_host,
                               s.spec.keep_gathered, s.spec.grad_stays_on_device});
  return out;
}

}  // namespace gx::torch_layer
