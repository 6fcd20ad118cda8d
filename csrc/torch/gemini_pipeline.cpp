// GeminiManager, the optimizer pipeline and the optimizer's entry points. Host sets' CPU
// optimizer steps run on a background thread in forward order while the caller goes on
// (zero_grad, the next batch, the next forward); each set is settled (its step waited for, P's
// other copy made coherent) the first time something needs its chunks (core/optimizer_pipeline.h).
// The optimizer step itself is hybrid_optimizer.cpp; every entry point below holds the lock.
#include "core/errors.h"
#include "torch/gemini_manager.h"

namespace gx::torch_layer {

void GeminiManager::launch_host_step_locked(int set_index, std::function<void()> compute,
                                            std::function<void()> complete, std::function<bool()> eager) {
  // The next forward's order decides which finished-gradient set the optimizer thread takes next.
  const int64_t priority = forward_rank_.at(static_cast<size_t>(set_index));
  pipeline_.launch(set_index, std::move(compute), std::move(complete), std::move(eager), priority);
  if (!overlap_optimizer_) settle_locked(set_index);
}

void GeminiManager::guard_stepping_params() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  for (int s : pipeline_.pending_sets()) storages_->set_stepping(sets_[static_cast<size_t>(s)].spec.param, true);
}

void GeminiManager::settle_all() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  settle_all_locked();
}

size_t GeminiManager::pending_steps() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  return pipeline_.pending_count();
}

void GeminiManager::refresh_forward_order_locked() {
  forward_order_.clear();
  std::vector<uint8_t> seen(sets_.size(), 0);
  for (ChunkId c : trace_.recorded()) {
    const int s = set_of_chunk(c);
    if (s < 0 || seen[static_cast<size_t>(s)]) continue;
    seen[static_cast<size_t>(s)] = 1;
    forward_order_.push_back(s);
  }
  for (size_t s = 0; s < sets_.size(); ++s)
    if (!seen[s]) forward_order_.push_back(static_cast<int>(s));
  forward_rank_.assign(sets_.size(), 0);
  for (size_t k = 0; k < forward_order_.size(); ++k) forward_rank_[static_cast<size_t>(forward_order_[k])] = static_cast<int64_t>(k);
}

void GeminiManager::hold_optimizer_thread(bool hold) { pipeline_.hold(hold); }

void GeminiManager::set_optimizer_task_delay_us(int64_t delay_us) { pipeline_.set_task_delay_us(delay_us); }

// --- the optimizer's entry points ---------------------------------------------------------------

void GeminiManager::attach_optimizer(const std::string& rule, std::vector<int> group_of_param) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  GX_CHECK(!optimizer_, "attach_optimizer: this manager has an optimizer already; there can be only one.");
  auto opt = std::make_unique<HybridOptimizer>(*this, make_optimizer_rule(rule));
  opt->set_param_groups(std::move(group_of_param));
  optimizer_ = std::move(opt);
}

HybridOptimizer& GeminiManager::optimizer_locked() {
  GX_CHECK(optimizer_, "the engine has no optimizer yet: create it with engine.optimizer(...) first.");
  return *optimizer_;
}

double GeminiManager::grad_norm_sq() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  return optimizer_locked().grad_norm_sq();
}

void GeminiManager::optimizer_step(const std::vector<HyperValues>& groups, double grad_multiplier) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  optimizer_locked().step(groups, grad_multiplier);
}

void GeminiManager::arm_speculation(const std::vector<HyperValues>& groups) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  optimizer_locked().arm(groups);
}

void GeminiManager::disarm_speculation() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  optimizer_locked().disarm();
}

bool GeminiManager::speculation_armed() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  return optimizer_locked().armed();
}

size_t GeminiManager::spare_bytes_needed() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  return optimizer_locked().spare_bytes_needed();
}

size_t GeminiManager::spare_bytes() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  return optimizer_locked().spare_bytes();
}

void GeminiManager::release_spares() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  if (optimizer_) optimizer_->release_spares();
}

std::pair<int64_t, int64_t> GeminiManager::speculations() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  return {optimizer_locked().speculations_confirmed(), optimizer_locked().speculations_dropped()};
}

StepStats GeminiManager::last_step() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  return optimizer_locked().last_step();
}

}  // namespace gx::torch_layer
