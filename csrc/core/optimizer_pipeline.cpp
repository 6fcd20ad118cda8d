#include "core/optimizer_pipeline.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <thread>

#include "core/errors.h"

namespace gx {

OptimizerPipeline::OptimizerPipeline(std::function<void(int)> on_settled, std::function<std::string(int)> describe)
    : on_settled_(std::move(on_settled)), describe_(std::move(describe)) {}

OptimizerPipeline::~OptimizerPipeline() { drain(); }

void OptimizerPipeline::drain() {
  for (auto& worker : workers_)
    if (worker) worker->drain();
}

void OptimizerPipeline::launch(int set, std::function<void()> compute, std::function<void()> complete,
                               std::function<bool()> eager, int64_t priority, StepLane lane, const char* what) {
  GX_INTERNAL_ASSERT(!pending(set), "chunk set ", set, " launched while its previous step is pending");
  std::unique_ptr<SerialExecutor>& worker = workers_[static_cast<int>(lane)];
  if (!worker) worker = std::make_unique<SerialExecutor>();
  auto seconds = std::make_shared<double>(0.0);
  std::function<void()> timed = [compute = std::move(compute), seconds, gate = gate_] {
    const auto t0 = std::chrono::steady_clock::now();
    if (gate->delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(gate->delay_us));
    compute();
    *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  if (ranges_->active())
    timed = ranges_->traced(detail::concat("gx.", lane == StepLane::kLink ? "link " : "cpu ", what, " set ", set),
                            std::move(timed));
  std::shared_future<void> done = worker->submit([timed = std::move(timed), gate = gate_] {
    {
      std::unique_lock<std::mutex> lock(gate->mutex);
      gate->opened.wait(lock, [&] { return !gate->held; });
    }
    timed();
  }, priority);
  pending_.emplace(set, Pending{std::move(done), std::move(complete), seconds, std::move(eager), lane});
  order_.push_back(set);
  if (!overlap_) settle(set);
}

void OptimizerPipeline::settle(int set) {
  auto it = pending_.find(set);
  if (it == pending_.end()) return;
  Pending step = std::move(it->second);
  pending_.erase(it);
  order_.erase(std::find(order_.begin(), order_.end(), set));
  wait_for(step.done, set);
  try {
    step.done.get();  // rethrows what the CPU step threw
  } catch (const std::exception& e) {
    throw InternalError(detail::concat("gemini_ext: the CPU optimizer step of ", describe_(set),
                                       " failed on the optimizer thread: ", e.what(),
                                       ". Its master weights and optimizer state may be partly updated: reload the "
                                       "last checkpoint."));
  }
  step_seconds_[static_cast<int>(step.lane)] += *step.seconds;
  step.complete();
  on_settled_(set);
}

void OptimizerPipeline::wait(int set) {
  auto it = pending_.find(set);
  if (it != pending_.end()) wait_for(it->second.done, set);
}

void OptimizerPipeline::wait_for(std::shared_future<void>& done, int set) {
  if (done.wait_for(std::chrono::seconds(0)) == std::future_status::ready) return;
  std::shared_ptr<void> range = ranges_->active() ? ranges_->open(detail::concat("gx.wait set ", set)) : nullptr;
  const auto t0 = std::chrono::steady_clock::now();
  done.wait();
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  waits_ += 1;
}

bool OptimizerPipeline::try_settle(int set) {
  auto it = pending_.find(set);
  if (it == pending_.end()) return true;
  if (it->second.done.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
  settle(set);
  return true;
}

void OptimizerPipeline::settle_all() {
  while (!order_.empty()) settle(order_.front());
}

void OptimizerPipeline::settle_finished() {
  for (int s : std::vector<int>(order_.begin(), order_.end())) {
    auto it = pending_.find(s);
    if (it == pending_.end()) continue;
    if (it->second.eager && !it->second.eager()) continue;  // speculative, not confirmed yet
    try_settle(s);                                           // only if it finished
  }
}

void OptimizerPipeline::hold(bool hold) {
  {
    std::lock_guard<std::mutex> lock(gate_->mutex);
    gate_->held = hold;
  }
  gate_->opened.notify_all();
}

void OptimizerPipeline::set_task_delay_us(int64_t delay) {
  std::lock_guard<std::mutex> lock(gate_->mutex);
  gate_->delay_us = delay;
}

}  // namespace gx
