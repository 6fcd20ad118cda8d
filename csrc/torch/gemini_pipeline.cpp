// GeminiManager, part 4: the optimizer pipeline. Host sets' CPU optimizer steps run on a
// background thread in forward order while the caller goes on (zero_grad, the next batch, the
// next forward); each set is settled (its step waited for, P's other copy made coherent) the
// first time something needs its chunks. See gemini_manager.h and hybrid_adam.h.
#include <chrono>
#include <exception>
#include <thread>

#include "core/errors.h"
#include "torch/gemini_manager.h"

namespace gx::torch_layer {

void GeminiManager::launch_host_step_locked(int set_index, std::function<void()> compute,
                                            std::function<void()> complete, std::function<bool()> eager) {
  GX_INTERNAL_ASSERT(!pending_locked(set_index), "chunk set ", set_index, " launched while its previous step is pending");
  if (!optimizer_worker_) optimizer_worker_ = std::make_unique<SerialExecutor>();
  auto seconds = std::make_shared<double>(0.0);
  // The next forward's order decides which finished-gradient set the optimizer thread takes next.
  const int64_t priority = forward_rank_.at(static_cast<size_t>(set_index));
  std::shared_future<void> done = optimizer_worker_->submit([compute = std::move(compute), seconds, gate = gate_] {
    {
      std::unique_lock<std::mutex> lock(gate->mutex);
      gate->opened.wait(lock, [&] { return !gate->held; });
    }
    if (gate->delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(gate->delay_us));
    const auto t0 = std::chrono::steady_clock::now();
    compute();
    *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }, priority);
  pending_.emplace(set_index, PendingStep{std::move(done), std::move(complete), seconds, std::move(eager)});
  pending_order_.push_back(set_index);
  if (!overlap_optimizer_) settle_locked(set_index);
}

void GeminiManager::settle_locked(int set_index) {
  auto it = pending_.find(set_index);
  if (it == pending_.end()) return;
  PendingStep step = std::move(it->second);
  pending_.erase(it);
  for (auto o = pending_order_.begin(); o != pending_order_.end(); ++o) {
    if (*o == set_index) {
      pending_order_.erase(o);
      break;
    }
  }
  if (step.done.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    const auto t0 = std::chrono::steady_clock::now();
    step.done.wait();
    counters_.optimizer_wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    counters_.optimizer_waits += 1;
  }
  try {
    step.done.get();  // rethrows what the CPU step threw
  } catch (const std::exception& e) {
    throw InternalError(detail::concat(
        "gemini_ext: the CPU optimizer step of chunk set ", set_index, " (parameter chunk ",
        sets_[static_cast<size_t>(set_index)].spec.param, ") failed on the optimizer thread: ", e.what(),
        ". Its master weights and moments may be partly updated: reload the last checkpoint."));
  }
  host_step_seconds_ += *step.seconds;
  step.complete();
  storages_->set_stepping(sets_[static_cast<size_t>(set_index)].spec.param, false);
}

void GeminiManager::guard_stepping_params() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  for (int s : pending_order_) storages_->set_stepping(sets_[static_cast<size_t>(s)].spec.param, true);
}

bool GeminiManager::try_settle_locked(int set_index) {
  auto it = pending_.find(set_index);
  if (it == pending_.end()) return true;
  if (it->second.done.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
  settle_locked(set_index);
  return true;
}

void GeminiManager::settle_all_locked() {
  while (!pending_order_.empty()) settle_locked(pending_order_.front());
}

void GeminiManager::settle_all() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  settle_all_locked();
}

size_t GeminiManager::pending_steps() const { return pending_.size(); }

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

void GeminiManager::hold_optimizer_thread(bool hold) {
  {
    std::lock_guard<std::mutex> lock(gate_->mutex);
    gate_->held = hold;
  }
  gate_->opened.notify_all();
}

void GeminiManager::set_optimizer_task_delay_us(int64_t delay_us) {
  std::lock_guard<std::mutex> lock(gate_->mutex);
  gate_->delay_us = delay_us;
}

double GeminiManager::host_step_seconds() const { return host_step_seconds_; }

void GeminiManager::reset_host_step_seconds() { host_step_seconds_ = 0.0; }

}  // namespace gx::torch_layer
