#include "torch/optim/hybrid_optimizer.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linalg_vector_norm.h>

#include <algorithm>
#include <chrono>
#include <set>

#include "core/errors.h"
#include "core/kernels/stochastic_round.h"
#include "torch/chunk_views.h"
#include "torch/mapped_view.h"
#include "torch/optim/device_adam_op.h"

#ifdef GX_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace gx::torch_layer {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

std::vector<PlannedRun> HybridOptimizer::runs_of(const ChunkSet& set, size_t num_groups) const {
  const Chunk& pc = mgr_.chunk(set.spec.param);
  std::vector<int> group_of_slot(pc.num_slots());
  std::vector<SlotExtent> slots(pc.num_slots());
  for (size_t k = 0; k < pc.num_slots(); ++k) {
    group_of_slot[k] = group_of_param_[static_cast<size_t>(set.params[k])];
    slots[k] = SlotExtent{pc.slot(k).offset_numel, pc.slot(k).numel};
  }
  const ShardRange shard = pc.shard_range(mgr_.rank());
  return plan_runs(set.has_grad, group_of_slot, set.step, slots, shard.begin_numel, shard.end_numel, num_groups);
}

void HybridOptimizer::launch_host_step(const char* what, int set_index, std::function<void()> compute,
                                       std::function<void()> complete, std::function<bool()> eager, StepLane lane) {
  // The next forward's order decides which finished-gradient set the optimizer thread takes next.
  const int64_t priority = order_.rank.at(static_cast<size_t>(set_index));
  pipeline_.launch(set_index, std::move(compute), std::move(complete), std::move(eager), priority, lane, what);
}

void HybridOptimizer::set_link_sets(const std::vector<int>& sets) {
  for (int s : sets)
    GX_CHECK(s >= 0 && static_cast<size_t>(s) < sets_.size(), "set_link_sets: chunk set ", s, " does not exist (",
             sets_.size(), " sets).");
  link_sets_ = std::set<int>(sets.begin(), sets.end());
}

std::function<void()> HybridOptimizer::link_run(const RunViews& host, int64_t step, const HyperValues& hyper,
                                                double grad_multiplier) const {
  RunViews v = host;
  v.device_max_blocks = kLinkLaneBlocks;  // the link's bandwidth, not the SMs: those compute meanwhile
  const c10::Device device = ctx_.device_for(Tier::kDevice);
  if (device.is_cuda()) {
    v.master = mapped_chunk_view(host.master, device);
    for (at::Tensor& t : v.states) t = mapped_chunk_view(t, device);
    v.grad = mapped_chunk_view(host.grad, device);
    if (host.param16.defined()) v.param16 = mapped_chunk_view(host.param16, device);
  }
  return [rule = rule_, v, step, hyper, grad_multiplier] {
    const bool wrote_param16 = rule->device_run(v, step, hyper, grad_multiplier);
    if (v.param16.defined() && !wrote_param16) v.param16.copy_(v.master);  // the rounded copy for compute
  };
}

std::function<void()> HybridOptimizer::link_task(std::vector<std::function<void()>> runs) const {
  const c10::Device device = ctx_.device_for(Tier::kDevice);
  return [runs = std::move(runs), device] {
#ifdef GX_WITH_CUDA
    if (device.is_cuda()) {
      const c10::cuda::CUDAGuard guard(device);
      const c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool(false, device.index());
      const c10::cuda::CUDAStreamGuard on_stream(stream);
      for (const auto& run : runs) run();
      stream.synchronize();  // the host copies hold the results: the set may be settled
      return;
    }
#endif
    for (const auto& run : runs) run();
  };
}

void HybridOptimizer::wait_grads() {
  for (const ChunkSet& set : sets_)
    if (set.trainable && mgr_.in_flight(set.spec.grad)) mgr_.wait(set.spec.grad);
}

double HybridOptimizer::all_reduce_sum(double local) {
  if (!mgr_.sharded()) return local;
  at::Tensor t = at::full({1}, local, at::TensorOptions().dtype(at::kDouble).device(ctx_.device_for(Tier::kDevice)));
  mgr_.communicator()->all_reduce(t.data_ptr(), 1, DType::kFloat64, ReduceOp::kSum, StreamKind::kCompute);
  return t.item<double>();
}

void refresh_device_param_copy(ChunkManager& mgr, ChunkId p, Tier host, bool home_on_host) {
  if (!mgr.chunk(p).shard_tiers().contains(Tier::kDevice)) return;
  if (home_on_host) {
    mgr.discard_copy(p, Tier::kDevice);
  } else {
    mgr.transfer(p, host, Tier::kDevice, /*async=*/true);
  }
}

HybridOptimizer::HybridOptimizer(DeviceContext& ctx, ChunkManager& mgr, std::vector<ChunkSet>& sets,
                                 const std::vector<at::Tensor>& grad_sq, const std::vector<ParamSpec>& params,
                                 Residency& residency,
                                 OptimizerPipeline& pipeline, const ForwardOrder& order,
                                 std::unique_ptr<OptimizerRule> rule)
    : ctx_(ctx),
      mgr_(mgr),
      sets_(sets),
      grad_sq_(grad_sq),
      params_(params),
      residency_(residency),
      pipeline_(pipeline),
      order_(order),
      rule_(std::move(rule)) {
  for (const ChunkSet& set : sets_) {
    if (!set.trainable) continue;
    GX_CHECK(set.spec.states.size() == rule_->state_kinds().size(), "optimizer: chunk set of parameter chunk ",
             set.spec.param, " carries ", set.spec.states.size(), " state chunks, the rule needs ",
             rule_->state_kinds().size(), ".");
    for (size_t k = 0; k < set.spec.states.size(); ++k)
      GX_CHECK(set.spec.states[k].first == rule_->state_kinds()[k], "optimizer: chunk set of parameter chunk ",
               set.spec.param, " carries state '", state_kind_name(set.spec.states[k].first),
               "' where the rule needs '", state_kind_name(rule_->state_kinds()[k]), "'.");
  }
}

HybridOptimizer::~HybridOptimizer() {
  try {
    settle_guesses();        // unjudged guesses are undone
    pipeline_.settle_all();  // judged ones' completions use this optimizer
    release_spares();  // settles this optimizer's speculative steps first
  } catch (...) {
  }
}

StepStats HybridOptimizer::last_step() const {
  StepStats out = stats_;
  out.host_seconds = pipeline_.host_step_seconds(StepLane::kCpu);
  out.link_seconds = pipeline_.host_step_seconds(StepLane::kLink);
  out.pending_sets = static_cast<int64_t>(pipeline_.pending_count());
  if (out.guessed_sets > 0) {
    out.skipped_sets = guess_counts_->skipped.load();
    out.correction_seconds = static_cast<double>(guess_counts_->correction_ns.load()) * 1e-9;
  }
  return out;
}

void HybridOptimizer::set_param_groups(std::vector<int> group_of_param) {
  GX_CHECK(group_of_param.size() == params_.size(), "set_param_groups: expected ", params_.size(),
           " entries (one per parameter), got ", group_of_param.size(), ".");
  for (size_t i = 0; i < group_of_param.size(); ++i)
    GX_CHECK(group_of_param[i] < 0 || params_[i].trainable, "parameter ", i,
             " is frozen (requires_grad=False) and cannot be in an optimizer's param_groups.");
  group_of_param_ = std::move(group_of_param);
}

double HybridOptimizer::grad_norm_sq() {
  DeviceContext& ctx = ctx_;
  ChunkManager& mgr = mgr_;
  // No settling: pending CPU steps (speculative ones included) only read the gradients too.
  ctx.sync_compute_stream();
  wait_grads();
  at::Tensor device_total, host_total;
  for (size_t s = 0; s < sets_.size(); ++s) {
    const ChunkSet& set = sets_[s];
    if (!set.trainable || set.grad_place == GradPlace::kNone) continue;
    const Tier tier = set.grad_place == GradPlace::kDevice ? Tier::kDevice : mgr.host_tier();
    at::Tensor sq;
    bool on_device = tier == Tier::kDevice;
    if (set.grad_place == GradPlace::kHost && grad_sq_[s].defined()) {
      sq = grad_sq_[s];  // taken on the device when G left for the host
      on_device = true;
    } else {
      sq = at::linalg_vector_norm(shard_view(ctx, mgr, set.spec.grad, tier), 2, std::nullopt, false, at::kFloat)
               .square();
    }
    at::Tensor& total = on_device ? device_total : host_total;
    total = total.defined() ? total + sq : sq;
  }
  double sum = 0.0;
  if (device_total.defined()) sum += device_total.item<double>();
  if (host_total.defined()) sum += host_total.item<double>();
  return all_reduce_sum(sum);  // sharded: every rank's shards (padding and gaps hold zeros)
}

RunViews HybridOptimizer::set_views(const ChunkSet& set, Tier tier, bool with_param16) const {
  DeviceContext& ctx = ctx_;
  ChunkManager& mgr = mgr_;
  const bool has_master = set.spec.master >= 0;
  RunViews v;
  v.master = shard_view(ctx, mgr, has_master ? set.spec.master : set.spec.param, tier);
  for (const auto& [kind, id] : set.spec.states) v.states.push_back(shard_view(ctx, mgr, id, tier));
  v.grad = shard_view(ctx, mgr, set.spec.grad, tier);
  if (has_master && with_param16) v.param16 = shard_view(ctx, mgr, set.spec.param, tier);
  return v;
}

RunViews HybridOptimizer::run_views(const RunViews& whole, const ChunkSet& set, int64_t begin, int64_t n,
                                    int64_t step) const {
  RunViews v = narrow_run(whole, begin, n);
  const ShardRange shard = mgr_.chunk(set.spec.param).shard_range(mgr_.rank());
  v.random_key = stochastic_key(step, set.spec.param);
  v.first_index = static_cast<uint32_t>(shard.begin_numel + begin);
  return v;
}

void HybridOptimizer::for_each_run(const ChunkSet& set, const std::vector<PlannedRun>& runs, const RunViews& whole,
                                   const std::function<void(const PlannedRun&, const RunViews&)>& fn) const {
  for (const PlannedRun& r : runs)
    if (r.shard_numel() > 0) fn(r, run_views(whole, set, r.shard_begin, r.shard_numel(), r.step_after));
}

std::vector<std::pair<size_t, int64_t>> HybridOptimizer::steps_after(const ChunkSet& set,
                                                                     const std::vector<PlannedRun>& runs) {
  std::vector<std::pair<size_t, int64_t>> out;
  for (const PlannedRun& r : runs)
    for (size_t k = r.first_slot; k <= r.last_slot; ++k)
      if (set.has_grad[k]) out.emplace_back(k, r.step_after);
  return out;
}

RunViews narrow_run(const RunViews& set, int64_t begin, int64_t n) {
  RunViews v;
  v.master = set.master.narrow(0, begin, n);
  for (const at::Tensor& t : set.states) v.states.push_back(t.narrow(0, begin, n));
  v.grad = set.grad.narrow(0, begin, n);
  if (set.param16.defined()) v.param16 = set.param16.narrow(0, begin, n);
  return v;
}

EarlyStepDecision HybridOptimizer::backward_started(const std::vector<HyperValues>& groups, EarlyStepFacts facts) {
  facts.rule_steps_whole_sets = rule_->steps_whole_sets();
  facts.rule_corrects_in_place = guess_supported();
  facts.spare_bytes_held = static_cast<int64_t>(spare_bytes());
  facts.spare_bytes_all = 0;
  facts.spare_bytes_least.reset();
  for (const ChunkSet& set : sets_) {
    if (!set.trainable || !set.spec.optim_on_host) continue;
    const auto bytes = static_cast<int64_t>(spare_bytes_needed(set));
    facts.spare_bytes_least = std::min(facts.spare_bytes_least.value_or(bytes), bytes);
    facts.spare_bytes_all += bytes;
  }
  const EarlyStepDecision decision = policy_.decide(facts);
  switch (decision.mode) {
    case EarlyMode::kSpares:  // see [Note: speculative CPU steps] (hybrid_optimizer_speculation.cpp)
      arm_spares(groups, decision.spare_allowance_bytes);
      break;
    case EarlyMode::kInPlace:  // see [Note: in-place speculation] (hybrid_optimizer_in_place.cpp)
      arm_guess(groups);
      break;
    case EarlyMode::kInBackward: arm_in_backward(groups); break;
    case EarlyMode::kAtStep: break;
  }
  return decision;
}

void HybridOptimizer::step(const std::vector<HyperValues>& groups, double grad_multiplier) {
  GX_CHECK(!group_of_param_.empty() || params_.empty(), "optimizer step before set_param_groups.");
  DeviceContext& ctx = ctx_;
  // Speculative steps started during backward: confirmed when they used what this step uses,
  // else settled (waited for) and dropped, and those sets are stepped below like the others.
  stats_ = backward_stats_;  // the sets stepped in place during backward count to this step
  backward_stats_ = StepStats{};
  // Steps started in backward: this step's seconds count from the arming.
  const bool started_in_backward = !stepped_in_backward_.empty() || !guesses_.empty();
  std::set<int> confirmed = judge_guesses(groups, grad_multiplier);
  policy_.step_taken(grad_multiplier);
  for (int s : judge_speculations(groups, grad_multiplier)) confirmed.insert(s);
  // Steps of an earlier call still pending (an unusual loop: normally forward settled them).
  for (int s : std::vector<int>(pipeline_.pending_sets().begin(), pipeline_.pending_sets().end()))
    if (confirmed.count(s) == 0) pipeline_.settle(s);
  ctx.sync_compute_stream();
  wait_grads();
  // The CPU kernel writes P's host copies: every H2D copy still reading them must be done.
  ctx.backend().synchronize(StreamKind::kHostToDevice);
  if (!started_in_backward) pipeline_.reset_host_step_seconds();
  residency_.unpin_all();
  residency_.ungather_all_kept();  // a gathered parameter buffer would go stale
  for (const int set_index : order_.sets) {
    const ChunkSet& set = sets_[static_cast<size_t>(set_index)];
    if (!set.trainable || set.grad_place == GradPlace::kNone) continue;
    if (confirmed.count(set_index) != 0) continue;  // stepped during backward (speculatively, or in place)
    step_set(set_index, groups, grad_multiplier, stats_);
  }
}

void HybridOptimizer::prepare_device_set(ChunkSet& set) {
  ChunkManager& mgr = mgr_;
  residency_.pin(set.spec.grad);
  if (mgr_.sharded()) {
    residency_.ensure_shard_on_device(set.spec.param);
  } else {
    residency_.ensure_on_device(set.spec.param);
  }
  residency_.pin(set.spec.param);
  if (set.grad_place == GradPlace::kHost) {  // gradients waited on the host (evicted, or a second backward)
    residency_.allocate_on_device(set.spec.grad);
    mgr.transfer(set.spec.grad, mgr.host_tier(), Tier::kDevice);
    set.grad_place = GradPlace::kDevice;
  }
}

void HybridOptimizer::ready_set(ChunkSet& set) {
  if (set.spec.optim_on_host) {
    GX_INTERNAL_ASSERT(set.grad_place == GradPlace::kHost, "chunk ", set.spec.param,
                       ": gradients not on the host for a host optimizer step");
  } else {
    prepare_device_set(set);
  }
}

void HybridOptimizer::finish_device_set(ChunkSet& set) {
  ChunkManager& mgr = mgr_;
  for (Tier t : {Tier::kPinnedHost, Tier::kPageableHost})
    if (mgr.chunk(set.spec.param).shard_tiers().contains(t)) mgr.discard_copy(set.spec.param, t);
  residency_.unpin_all();
}

void HybridOptimizer::step_set(int set_index, const std::vector<HyperValues>& groups, double grad_multiplier,
                               StepStats& stats, std::shared_ptr<Event> grads_landed,
                               std::shared_ptr<EarlyStepLifecycle> life) {
  ChunkManager& mgr = mgr_;
  ChunkSet& set = sets_[static_cast<size_t>(set_index)];
  auto stepped = [life] {
    if (life) life->apply(EarlyStepEvent::kTaskStepped);
  };
  const std::vector<PlannedRun> runs = runs_of(set, groups.size());
  if (runs.empty()) return stepped();
  if (rule_->steps_whole_sets()) {
    step_whole_set(set_index, runs, grad_multiplier);
    return stepped();
  }
  const bool on_host = set.spec.optim_on_host;
  const bool link = on_host && link_sets_.count(set_index) != 0 && rule_->steps_over_the_link();
  const bool has_master = set.spec.master >= 0;
  const Tier host = mgr.host_tier();
  const auto t0 = std::chrono::steady_clock::now();
  ready_set(set);
  const Tier tier = on_host ? host : Tier::kDevice;
  const RunViews whole = set_views(set, tier, /*with_param16=*/true);  // this rank's shards, once per set
  std::vector<std::function<void()>> host_work;  // on_host: the runs, checked here, run on the optimizer thread
  for_each_run(set, runs, whole, [&](const PlannedRun& r, const RunViews& views) {
    const HyperValues& h = groups[static_cast<size_t>(r.group)];
    const int64_t n = r.shard_numel();
    if (link) {
      host_work.push_back(link_run(views, r.step_after, h, grad_multiplier));
      stats.link_params += n;
    } else if (on_host) {
      host_work.push_back(rule_->prepare_host_run(views, nullptr, r.step_after, h, grad_multiplier));
      stats.host_params += n;
    } else {
      const bool wrote_param16 = rule_->device_run(views, r.step_after, h, grad_multiplier);
      if (has_master && !wrote_param16) views.param16.copy_(views.master);  // the rounded copy for compute
      stats.device_params += n;
    }
  });
  for (const auto& [k, step] : steps_after(set, runs)) set.step[k] = step;
  // Coherence of P's other copy.
  const ChunkId p = set.spec.param;
  if (!on_host) {
    finish_device_set(set);
    stats.device_seconds += seconds_since(t0);
    return stepped();
  }
  // [Note: the overlapped CPU step]
  // The update runs on the optimizer thread while the caller goes on; the step is exact
  // because everything it depends on is final here: the gradients are complete and on the
  // host, the clipping coefficient and the fp16 overflow decision were taken from the global
  // norm before this call, and the hyperparameters are read now. Only P's device copy is
  // stale until the set is settled (see torch/manager/manager.h: the next forward waits for this
  // set only when it reaches its chunk, prefetch refreshes it as soon as it is done). So the
  // result equals the serial step bit for bit; what overlaps is the CPU work with whatever
  // the caller does next (zero_grad, data loading, the next forward up to this chunk).
  ChunkManager* chunks = &mgr;
  const bool home_on_host = set.spec.param_home_on_host;
  auto complete = [chunks, p, host, home_on_host] { refresh_device_param_copy(*chunks, p, host, home_on_host); };
  if (grads_landed && !host_work.empty())  // the step started during backward: its gradients may still be on the way
    host_work.insert(host_work.begin(), [grads_landed] { grads_landed->synchronize(); });
  if (host_work.empty()) {
    complete();
    stepped();
  } else if (link) {
    launch_host_step("step", set_index, [task = link_task(std::move(host_work)), stepped] {
      task();
      stepped();
    }, std::move(complete), nullptr, StepLane::kLink);
  } else {
    launch_host_step("step", set_index, [work = std::move(host_work), stepped] {
      for (const auto& run : work) run();
      stepped();
    }, std::move(complete));
  }
  stats.launch_seconds += seconds_since(t0);
}

void HybridOptimizer::step_whole_set(int set_index, const std::vector<PlannedRun>& runs, double grad_multiplier) {
  ChunkManager& mgr = mgr_;
  ChunkSet& set = sets_[static_cast<size_t>(set_index)];
  const bool on_host = set.spec.optim_on_host;
  const Tier host = mgr.host_tier();
  const auto t0 = std::chrono::steady_clock::now();
  ready_set(set);
  const RunViews whole = set_views(set, on_host ? host : Tier::kDevice, /*with_param16=*/true);
  std::vector<int> params;
  int64_t stepped = 0;
  for (const PlannedRun& r : runs) {
    stepped += r.shard_numel();
    for (size_t k = r.first_slot; k <= r.last_slot; ++k)
      if (set.has_grad[k]) params.push_back(set.params[k]);
  }
  rule_->step_whole_set(set_index, whole, params, grad_multiplier);
  if (whole.param16.defined()) whole.param16.copy_(whole.master);  // the rounded copy for compute
  for (const auto& [k, step] : steps_after(set, runs)) set.step[k] = step;
  const ChunkId p = set.spec.param;
  if (on_host) {
    refresh_device_param_copy(mgr, p, host, set.spec.param_home_on_host);
    stats_.host_params += stepped;
    stats_.launch_seconds += seconds_since(t0);
  } else {
    finish_device_set(set);
    stats_.device_params += stepped;
    stats_.device_seconds += seconds_since(t0);
  }
}

}  // namespace gx::torch_layer
