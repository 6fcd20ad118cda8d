// HybridOptimizer, part 3: the host sets' steps taken in place during backward, then judged.
//
// [Note: in-place speculation]
// A host set's CPU step needs its gradients, final once they are on the host during backward,
// and what optimizer.step() decides afterwards: the clipping coefficient (from the global norm),
// the hyperparameters, the fp16 overflow skip. Where the rule can correct its own step (Adam /
// AdamW with fp32 state: core/kernels/adam_correction.h), each host set is stepped in place as
// soon as its gradients land, guessing a multiplier of exactly 1 and the hyperparameters of the
// backward's start, and writing master, moments and the 16-bit host copy of the parameters (by
// the CPU, or for the link lane's sets by the device's kernel over the link: the same bits). No
// spare memory is taken; a verdict's work runs on the CPU whichever lane stepped the set. step()
// then gives each set a verdict (core/early_step.h holds the lifecycle and the verdicts):
//   * the multiplier is 1 and the hyperparameters are the guessed ones: confirmed, nothing to
//     do, and the bits are the serial step's (the same kernel with the same inputs);
//   * the multiplier c is below 1 (clipping): one corrective pass per set, the bytes of one
//     step, on the optimizer thread where the clipped step would have run, within a few ulps of
//     the serial step (the Note in adam_correction.h);
//   * other hyperparameters: the step is undone and taken again with them (two passes; an LR
//     scheduler stepped between backward and step(), which training loops seldom do).
// A set whose gradients are not all finite is left alone by its task (checked before writing),
// and stepped as the serial step would at step(). A set needed before step() judged it (another
// backward adds to its gradients, a forward or a read reaches its chunks, zero_grad drops its
// gradients, a placement change) is undone when settled, and steps at step() like any other.
// A read is not such a need (see [Note: reading a guessed set]).
// The 16-bit parameters it wrote stay on the host until the verdict: the device copy of P is
// refreshed only by the settling of a judged set. fp16 loss scaling keeps the serial path
// (Python does not arm it), so do rules without a correction (they speculate with spares:
// hybrid_optimizer_speculation.cpp).
#include <algorithm>
#include <chrono>

#include "core/errors.h"
#include "core/kernels/adam_correction.h"
#include "core/early_step.h"
#include "torch/dtype_map.h"
#include "torch/optim/hybrid_optimizer.h"

namespace gx::torch_layer {

struct HybridOptimizer::Guess {
  struct RunPlan {
    RunViews views;
    int64_t step;  // the count after this update
    int group;
    int64_t begin;  // the run's first element, as an offset into this rank's shard
  };
  EarlyStepLifecycle lifecycle;
  std::vector<uint8_t> has_grad;      // as launched: verified by step()
  std::vector<int64_t> steps_before;  // per slot
  std::vector<std::pair<size_t, int64_t>> new_steps;  // slot -> step count once judged
  std::vector<RunPlan> runs;
  std::shared_ptr<const std::vector<HyperValues>> groups;  // as guessed
  int64_t host_params = 0;
  bool link = false;  // stepped by the link lane (the device's kernel over the host state)
  // The verdict's work, written by step() before it judges: for a set the task stepped, and for
  // one it left alone. The task runs it when judged early; else step() launches it.
  std::vector<std::function<void()>> if_stepped;
  std::vector<std::function<void()>> if_skipped;
  bool follow_up = false;  // step() launches the verdict's work after settling the task
};

namespace {
int64_t nanoseconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}

void run_all(const std::vector<std::function<void()>>& work) {
  for (const auto& w : work) w();
}
}  // namespace

bool HybridOptimizer::guess_supported() const {
  if (rule_->steps_whole_sets()) return false;  // nothing to start early
  for (const ChunkSet& set : sets_) {
    if (!set.trainable || !set.spec.optim_on_host) continue;
    const DType master = mgr_.chunk(set.spec.master >= 0 ? set.spec.master : set.spec.param).dtype();
    const DType state = set.spec.states.empty() ? DType::kFloat32 : mgr_.chunk(set.spec.states.front().second).dtype();
    if (!rule_->corrects_in_place(master, state)) return false;
  }
  return true;
}

void HybridOptimizer::arm_guess(const std::vector<HyperValues>& groups) {
  guess_groups_ = std::make_shared<const std::vector<HyperValues>>(groups);
  guessing_ = true;
  guess_counts_ = std::make_shared<GuessCounts>();  // this step's; the last step's corrections may still run
  pipeline_.reset_host_step_seconds();  // this step's lanes' seconds count from here
}

void HybridOptimizer::guess(int set_index) {
  ChunkManager& mgr = mgr_;
  ChunkSet& set = sets_[static_cast<size_t>(set_index)];
  if (!set.trainable || !set.spec.optim_on_host || set.grad_place != GradPlace::kHost) return;
  if (pipeline_.pending(set_index) || guesses_.count(set_index) != 0) return;
  const std::vector<HyperValues>& groups = *guess_groups_;
  for (size_t k = 0; k < set.params.size(); ++k) {  // a parameter outside the guessed groups: step() steps it
    const int group = group_of_param_[static_cast<size_t>(set.params[k])];
    if (set.has_grad[k] && group >= 0 && static_cast<size_t>(group) >= groups.size()) return;
  }
  const std::vector<PlannedRun> runs = runs_of(set, groups.size());
  if (runs.empty()) return;
  if (mgr.in_flight(set.spec.param)) mgr.wait(set.spec.param);  // a fetch may still read P's host copy
  auto g = std::make_shared<Guess>();
  g->has_grad = set.has_grad;
  g->steps_before = set.step;
  g->groups = guess_groups_;
  g->new_steps = steps_after(set, runs);
  const RunViews whole = set_views(set, mgr.host_tier(), /*with_param16=*/true);
  std::vector<std::function<void()>> work;
  struct GradRange {
    const void* data;
    DType dtype;
    int64_t numel;
  };
  std::vector<GradRange> grads;
  const bool link = link_sets_.count(set_index) != 0 && rule_->steps_over_the_link();  // the same bits
  g->link = link;
  for_each_run(set, runs, whole, [&](const PlannedRun& r, const RunViews& views) {
    const HyperValues& hyper = groups[static_cast<size_t>(r.group)];
    work.push_back(link ? link_run(views, r.step_after, hyper, 1.0)
                        : rule_->prepare_host_run(views, nullptr, r.step_after, hyper, 1.0));
    grads.push_back({views.grad.data_ptr(), to_gx_dtype(views.grad.scalar_type()), r.shard_numel()});
    g->runs.push_back({views, r.step_after, r.group, r.shard_begin});
    g->host_params += r.shard_numel();
  });
  guesses_[set_index] = g;
  std::shared_ptr<Event> grads_landed = mgr.copy_event(set.spec.grad);  // the D2H just started
  if (link) work = {link_task(std::move(work))};
  auto counts = guess_counts_;
  launch_host_step(
      "guess", set_index,
      [g, grads_landed, work = std::move(work), grads = std::move(grads), counts] {
        if (grads_landed) grads_landed->synchronize();
        bool finite = true;
        for (const GradRange& r : grads) finite = finite && all_finite(r.data, r.dtype, r.numel);
        if (finite) {
          run_all(work);
        } else {
          counts->skipped += 1;
        }
        const EarlyStepState before =
            g->lifecycle.apply(finite ? EarlyStepEvent::kTaskStepped : EarlyStepEvent::kTaskSkipped);
        if (before != EarlyStepState::kJudgedEarly) return;
        const auto t0 = std::chrono::steady_clock::now();
        run_all(finite ? g->if_stepped : g->if_skipped);
        counts->correction_ns += nanoseconds_since(t0);
      },
      [this, set_index, g] { finish_guess(set_index, g); },
      [g] { return g->lifecycle.state() == EarlyStepState::kJudged && !g->follow_up; },
      link ? StepLane::kLink : StepLane::kCpu);
}

void HybridOptimizer::finish_guess(int set_index, const std::shared_ptr<Guess>& g) {
  auto it = guesses_.find(set_index);
  if (it != guesses_.end() && it->second == g) guesses_.erase(it);
  const EarlyStepState state = g->lifecycle.state();
  if (state == EarlyStepState::kJudged) {
    if (!g->follow_up) {  // its verdict is complete: P's device copy may take the new values
      const ChunkSet& set = sets_[static_cast<size_t>(set_index)];
      refresh_device_param_copy(mgr_, set.spec.param, mgr_.host_tier(), set.spec.param_home_on_host);
    }
    return;
  }
  // Needed before step() judged it: undone, and step() steps the set like any other.
  if (g->lifecycle.apply(EarlyStepEvent::kUndo) == EarlyStepState::kStepped) {
    for (const Guess::RunPlan& r : g->runs)
      rule_->prepare_host_undo(r.views, r.step, (*g->groups)[static_cast<size_t>(r.group)], 1.0)();
  }
  undone_total_ += 1;
}

// [Note: reading a guessed set]
// Parameters or optimizer state read between backward and step() (a state dict, a checkpoint,
// a parameter's value) must be the values before the step, and the read must not change what
// step() computes. Undoing the guess in place would serve the first but not the second: the undo
// inverts the step's rounding only to within a few ulps, and the set is then stepped again from
// the perturbed values. So the guess stays: its task is waited for, and the read's copy is
// recomputed from the guessed values by the rule's undo, run on scratch copies of the slot's
// elements. step() then judges the guess as if nothing had been read, with the same bits as a
// run without the read. The values served are those before the step to within the undo's
// rounding (a few ulps; a moment that was zero comes back as zero or within an ulp of the
// gradient's term); exact reads there need host_step_speculation="spares" or "off". Sharded,
// a read is a collective over every rank's shard and the guess is undone as before.
std::set<int> HybridOptimizer::wait_guesses_for_read() {
  std::set<int> kept;
  if (respond(EarlyMode::kInPlace, Interruption::kRead, mgr_.world_size() > 1) != EarlyResponse::kServedBefore)
    return kept;  // the guesses are settled, and so undone, like every other pending set
  for (const auto& [s, g] : guesses_) {
    pipeline_.wait(s);
    kept.insert(s);
  }
  return kept;
}

bool HybridOptimizer::read_before_guess(int set_index, ChunkId chunk, size_t slot, at::Tensor& out) {
  auto it = guesses_.find(set_index);
  if (it == guesses_.end() ||
      respond(EarlyMode::kInPlace, Interruption::kRead, mgr_.world_size() > 1) != EarlyResponse::kServedBefore)
    return false;
  const std::shared_ptr<Guess>& g = it->second;
  if (g->lifecycle.state() != EarlyStepState::kStepped) return false;  // skipped: nothing was written
  const ChunkSet& set = sets_[static_cast<size_t>(set_index)];
  const bool has_master = set.spec.master >= 0;
  // Which of the run's views holds `chunk`: -1 the master, -2 the 16-bit copy, k >= 0 state k.
  int which = 0;
  if (chunk == (has_master ? set.spec.master : set.spec.param)) {
    which = -1;
  } else if (has_master && chunk == set.spec.param) {
    which = -2;
  } else {
    which = -3;
    for (size_t k = 0; k < set.spec.states.size(); ++k)
      if (set.spec.states[k].second == chunk) which = static_cast<int>(k);
    if (which == -3) return false;  // the gradient: the guess did not write it
  }
  const TensorSlot& s = mgr_.chunk(chunk).slot(slot);
  const int64_t first = s.offset_numel;
  const int64_t last = first + s.numel;
  at::Tensor flat = out.view({-1});
  bool any = false;
  for (const Guess::RunPlan& r : g->runs) {
    const int64_t a = std::max(first, r.begin);
    const int64_t b = std::min(last, r.begin + r.views.master.numel());
    if (a >= b) continue;
    RunViews scratch = narrow_run(r.views, a - r.begin, b - a);
    scratch.master = scratch.master.clone();
    for (at::Tensor& t : scratch.states) t = t.clone();
    if (scratch.param16.defined()) scratch.param16 = scratch.param16.clone();
    scratch.random_key = r.views.random_key;
    scratch.first_index = r.views.first_index + static_cast<uint32_t>(a - r.begin);
    rule_->prepare_host_undo(scratch, r.step, (*g->groups)[static_cast<size_t>(r.group)], 1.0)();
    const at::Tensor& value = which == -1   ? scratch.master
                              : which == -2 ? scratch.param16
                                            : scratch.states[static_cast<size_t>(which)];
    if (!value.defined()) continue;
    flat.narrow(0, a - first, b - a).copy_(value);
    any = true;
  }
  if (any) reads_before_guesses_ += 1;
  return any;
}

void HybridOptimizer::settle_guesses() {  // guesses_ holds the unjudged ones only
  for (const auto& [s, g] : std::map<int, std::shared_ptr<Guess>>(guesses_)) pipeline_.settle(s);
}

void HybridOptimizer::grads_cleared() {
  settle_guesses();
  policy_.grads_cleared();
}

std::set<int> HybridOptimizer::judge_guesses(const std::vector<HyperValues>& groups, double grad_multiplier) {
  std::set<int> judged;  // step() flushed the gradients first: gradients_complete() ended the guessing
  for (const auto& [s, g] : std::map<int, std::shared_ptr<Guess>>(guesses_)) {
    ChunkSet& set = sets_[static_cast<size_t>(s)];
    const bool same_inputs = set.grad_place == GradPlace::kHost && set.spec.optim_on_host &&
                             set.has_grad == g->has_grad && set.step == g->steps_before;
    const EarlyVerdict verdict = verdict_for(EarlyMode::kInPlace, same_inputs, *g->groups == groups, grad_multiplier);
    if (verdict == EarlyVerdict::kDrop) {
      pipeline_.settle(s);  // undone; stepped below like the other sets
      continue;
    }
    std::vector<std::function<void()>> serial;  // the serial step's runs, from the state before the guess
    for (const Guess::RunPlan& r : g->runs)
      serial.push_back(rule_->prepare_host_run(r.views, nullptr, r.step, groups[static_cast<size_t>(r.group)],
                                               grad_multiplier));
    if (verdict == EarlyVerdict::kRedo) {
      for (const Guess::RunPlan& r : g->runs)
        g->if_stepped.push_back(
            rule_->prepare_host_undo(r.views, r.step, (*g->groups)[static_cast<size_t>(r.group)], 1.0));
      g->if_stepped.insert(g->if_stepped.end(), serial.begin(), serial.end());
    } else if (verdict == EarlyVerdict::kCorrect) {
      for (const Guess::RunPlan& r : g->runs)
        g->if_stepped.push_back(rule_->prepare_host_correction(r.views, r.step, groups[static_cast<size_t>(r.group)],
                                                               1.0, grad_multiplier));
    }
    g->if_skipped = std::move(serial);
    for (const auto& [k, step] : g->new_steps) set.step[k] = step;
    judged.insert(s);
    judged_total_ += 1;
    if (verdict != EarlyVerdict::kConfirm) corrected_total_ += 1;
    stats_.guessed_sets += 1;
    (g->link ? stats_.link_params : stats_.host_params) += g->host_params;
    if (verdict == EarlyVerdict::kRedo) {
      stats_.redone_sets += 1;
    } else if (verdict == EarlyVerdict::kCorrect) {
      stats_.corrected_sets += 1;
    }
    guesses_.erase(s);  // judged: the next backward's guesses, and zero_grad, leave it alone
    const EarlyStepState before = g->lifecycle.apply(EarlyStepEvent::kJudge);
    if (before == EarlyStepState::kStepping) continue;  // the task runs the verdict's work when it ends
    const std::vector<std::function<void()>>& work = before == EarlyStepState::kStepped ? g->if_stepped : g->if_skipped;
    if (work.empty()) {
      pipeline_.settle(s);  // confirmed: P's device copy is refreshed
      continue;
    }
    g->follow_up = true;
    pipeline_.settle(s);  // the task has ended: this only frees the set's place in the pipeline
    ChunkManager* chunks = &mgr_;
    const ChunkId p = set.spec.param;
    const Tier host = mgr_.host_tier();
    const bool home_on_host = set.spec.param_home_on_host;
    auto counts = guess_counts_;
    launch_host_step(
        "correction", s,
        [work, counts] {
          const auto t0 = std::chrono::steady_clock::now();
          run_all(work);
          counts->correction_ns += nanoseconds_since(t0);
        },
        [chunks, p, host, home_on_host] { refresh_device_param_copy(*chunks, p, host, home_on_host); });
  }
  return judged;
}

}  // namespace gx::torch_layer
