#include "torch/hybrid_adam.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linalg_vector_norm.h>

#include <algorithm>
#include <chrono>
#include <set>

#include "core/errors.h"
#include "torch/cpu_adam_op.h"

namespace gx::torch_layer {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

std::vector<HybridAdam::Run> HybridAdam::runs_of_locked(const ChunkSet& set, size_t num_groups) const {
  const Chunk& pc = m_.chunks().chunk(set.spec.param);
  std::vector<Run> runs;
  for (size_t k = 0; k < pc.num_slots(); ++k) {
    const int group = group_of_param_[static_cast<size_t>(set.params[k])];
    if (!set.has_grad[k] || group < 0) continue;
    GX_CHECK(static_cast<size_t>(group) < num_groups, "parameter group ", group, " of parameter ", set.params[k],
             ": only ", num_groups, " groups were passed.");
    if (!runs.empty() && runs.back().last_slot + 1 == k && runs.back().group == group && runs.back().step == set.step[k]) {
      runs.back().last_slot = k;
    } else {
      runs.push_back(Run{k, k, group, set.step[k]});
    }
  }
  return runs;
}

HybridAdam::ShardPart HybridAdam::shard_part_of(const ChunkSet& set, const Run& r) const {
  const Chunk& pc = m_.chunks().chunk(set.spec.param);
  const ShardRange shard = pc.shard_range(m_.chunks().rank());
  const int64_t begin = std::max(pc.slot(r.first_slot).offset_numel, shard.begin_numel) - shard.begin_numel;
  const int64_t end =
      std::min(pc.slot(r.last_slot).offset_numel + pc.slot(r.last_slot).numel, shard.end_numel) - shard.begin_numel;
  return ShardPart{begin, end};
}

void refresh_device_param_copy(ChunkManager& mgr, ChunkId p, Tier host, bool home_on_host) {
  if (!mgr.chunk(p).shard_tiers().contains(Tier::kDevice)) return;
  if (home_on_host) {
    mgr.discard_copy(p, Tier::kDevice);
  } else {
    mgr.transfer(p, host, Tier::kDevice, /*async=*/true);
  }
}

HybridAdam::HybridAdam(GeminiManager& manager) : m_(manager) {
  std::lock_guard<OwnedMutex> lock(m_.mutex());
  m_.set_grads_offloaded_hook([this](int set_index) { speculate_locked(set_index); });
}

HybridAdam::~HybridAdam() {
  try {
    release_spares();  // settles this optimizer's speculative steps first
  } catch (...) {
  }
  std::lock_guard<OwnedMutex> lock(m_.mutex());
  m_.set_grads_offloaded_hook(nullptr);
}

StepStats HybridAdam::last_step() const {
  std::lock_guard<OwnedMutex> lock(m_.mutex());
  StepStats out = stats_;
  out.host_seconds = m_.host_step_seconds();
  out.pending_sets = static_cast<int64_t>(m_.pending_steps());
  return out;
}

void HybridAdam::set_param_groups(std::vector<int> group_of_param) {
  GX_CHECK(group_of_param.size() == m_.params().size(), "set_param_groups: expected ", m_.params().size(),
           " entries (one per parameter), got ", group_of_param.size(), ".");
  for (size_t i = 0; i < group_of_param.size(); ++i)
    GX_CHECK(group_of_param[i] < 0 || m_.params()[i].trainable, "parameter ", i,
             " is frozen (requires_grad=False) and cannot be in an optimizer's param_groups.");
  group_of_param_ = std::move(group_of_param);
}

double HybridAdam::grad_norm_sq() {
  std::lock_guard<OwnedMutex> lock(m_.mutex());
  DeviceContext& ctx = m_.context();
  ChunkManager& mgr = m_.chunks();
  // No settling: pending CPU steps (speculative ones included) only read the gradients too.
  ctx.sync_compute_stream();
  m_.wait_grads();
  at::Tensor device_total, host_total;
  for (const ChunkSet& set : m_.sets()) {
    if (!set.trainable || set.grad_place == GradPlace::kNone) continue;
    const Tier tier = set.grad_place == GradPlace::kDevice ? Tier::kDevice : mgr.host_tier();
    at::Tensor sq;
    bool on_device = tier == Tier::kDevice;
    if (set.grad_place == GradPlace::kHost && set.grad_sq.defined()) {
      sq = set.grad_sq;  // taken on the device when G left for the host
      on_device = true;
    } else {
      sq = at::linalg_vector_norm(shard_view(ctx, mgr, set.spec.grad, tier), 2, std::nullopt, false, at::kFloat).square();
    }
    at::Tensor& total = on_device ? device_total : host_total;
    total = total.defined() ? total + sq : sq;
  }
  double sum = 0.0;
  if (device_total.defined()) sum += device_total.item<double>();
  if (host_total.defined()) sum += host_total.item<double>();
  return m_.all_reduce_sum(sum);  // sharded: every rank's shards (padding and gaps hold zeros)
}

void HybridAdam::step(const std::vector<AdamHyper>& groups, double grad_multiplier) {
  std::lock_guard<OwnedMutex> lock(m_.mutex());
  GX_CHECK(!group_of_param_.empty() || m_.params().empty(), "HybridAdam::step before set_param_groups.");
  DeviceContext& ctx = m_.context();
  ChunkManager& mgr = m_.chunks();
  // Speculative steps started during backward: confirmed when they used what this step uses,
  // else settled (waited for) and dropped, and those sets are stepped below like the others.
  stats_ = StepStats{};
  const std::set<int> confirmed = judge_speculations_locked(groups, grad_multiplier);
  // Steps of an earlier call still pending (an unusual loop: normally forward settled them).
  for (int s : m_.pending_sets_locked())
    if (confirmed.count(s) == 0) m_.settle_locked(s);
  ctx.sync_compute_stream();
  m_.wait_grads();
  // CPU Adam writes P's host copies: every H2D copy still reading them must be done.
  ctx.backend().synchronize(StreamKind::kHostToDevice);
  m_.reset_host_step_seconds();
  m_.unpin_all_locked();
  m_.values_changed_locked();
  m_.ungather_all_locked();  // a gathered parameter buffer would go stale
  const Tier host = mgr.host_tier();
  // This rank's shard of every chunk: [shard_begin, shard_end) of the chunk's elements.
  const bool sharded = m_.sharded();

  for (const int set_index : m_.sets_in_forward_order()) {
    ChunkSet& set = m_.sets()[static_cast<size_t>(set_index)];
    if (!set.trainable || set.grad_place == GradPlace::kNone) continue;
    if (confirmed.count(set_index) != 0) continue;  // stepped speculatively during backward, confirmed above
    const Chunk& pc = mgr.chunk(set.spec.param);
    const std::vector<Run> runs = runs_of_locked(set, groups.size());
    if (runs.empty()) continue;
    const bool on_host = set.spec.optim_on_host;
    const bool has_master = set.spec.master >= 0;
    const auto t0 = std::chrono::steady_clock::now();
    if (on_host) {
      GX_INTERNAL_ASSERT(set.grad_place == GradPlace::kHost, "chunk ", set.spec.param,
                         ": gradients not on the host for a host optimizer step");
    } else {
      m_.pin_locked(set.spec.grad);
      if (sharded) {
        m_.ensure_shard_on_device_locked(set.spec.param);
      } else {
        m_.ensure_on_device_locked(set.spec.param);
      }
      m_.pin_locked(set.spec.param);
      if (set.grad_place == GradPlace::kHost) {  // gradients waited on the host (evicted, or a second backward)
        m_.allocate_on_device_locked(set.spec.grad);
        mgr.transfer(set.spec.grad, host, Tier::kDevice);
        set.grad_place = GradPlace::kDevice;
      }
    }
    const Tier tier = on_host ? host : Tier::kDevice;
    at::Tensor master = shard_view(ctx, mgr, has_master ? set.spec.master : set.spec.param, tier);
    at::Tensor exp_avg = shard_view(ctx, mgr, set.spec.exp_avg, tier);
    at::Tensor exp_avg_sq = shard_view(ctx, mgr, set.spec.exp_avg_sq, tier);
    at::Tensor grad = shard_view(ctx, mgr, set.spec.grad, tier);
    at::Tensor param16 = has_master ? shard_view(ctx, mgr, set.spec.param, tier) : at::Tensor();
    std::vector<CpuAdamWork> host_work;  // on_host: the runs, checked here, run on the optimizer thread
    for (const Run& r : runs) {
      // The run's elements that lie in this rank's shard, as offsets into the shard.
      const auto [begin, end] = shard_part_of(set, r);
      const int64_t n = end - begin;
      if (n <= 0) {  // the run lies in other ranks' shards: only the step count advances
        for (size_t k = r.first_slot; k <= r.last_slot; ++k)
          if (set.has_grad[k]) set.step[k] = r.step + 1;
        continue;
      }
      const AdamHyper& h = groups[static_cast<size_t>(r.group)];
      const int64_t step = r.step + 1;
      if (on_host) {
        std::optional<at::Tensor> p16;
        if (has_master) p16 = param16.narrow(0, begin, n);
        host_work.push_back(prepare_cpu_adam(master.narrow(0, begin, n), exp_avg.narrow(0, begin, n),
                                             exp_avg_sq.narrow(0, begin, n), grad.narrow(0, begin, n), p16, step, h.lr,
                                             h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled_weight_decay,
                                             grad_multiplier));
        stats_.host_params += n;
      } else {
        at::Tensor g = grad.narrow(0, begin, n).to(at::kFloat);
        if (grad_multiplier != 1.0) g = g.mul(grad_multiplier);
        at::Tensor p = master.narrow(0, begin, n);
        at::Tensor step_t = at::full({}, static_cast<double>(step), master.options());
        if (h.decoupled_weight_decay) {
          at::_fused_adamw_({p}, {g}, {exp_avg.narrow(0, begin, n)}, {exp_avg_sq.narrow(0, begin, n)}, {}, {step_t},
                            h.lr, h.beta1, h.beta2, h.weight_decay, h.eps, false, false);
        } else {
          at::_fused_adam_({p}, {g}, {exp_avg.narrow(0, begin, n)}, {exp_avg_sq.narrow(0, begin, n)}, {}, {step_t},
                           h.lr, h.beta1, h.beta2, h.weight_decay, h.eps, false, false);
        }
        if (has_master) param16.narrow(0, begin, n).copy_(p);
        stats_.device_params += n;
      }
      for (size_t k = r.first_slot; k <= r.last_slot; ++k)
        if (set.has_grad[k]) set.step[k] = step;
    }
    // Coherence of P's other copy.
    const ChunkId p = set.spec.param;
    if (on_host) {
      // [Note: the overlapped CPU step]
      // The update runs on the optimizer thread while the caller goes on; the step is exact
      // because everything it depends on is final here: the gradients are complete and on the
      // host, the clipping coefficient and the fp16 overflow decision were taken from the global
      // norm before this call, and the hyperparameters are read now. Only P's device copy is
      // stale until the set is settled (see gemini_manager.h: the next forward waits for this
      // set only when it reaches its chunk, prefetch refreshes it as soon as it is done). So the
      // result equals the serial step bit for bit; what overlaps is the CPU work with whatever
      // the caller does next (zero_grad, data loading, the next forward up to this chunk).
      ChunkManager* chunks = &mgr;
      const bool home_on_host = set.spec.param_home_on_host;
      auto complete = [chunks, p, host, home_on_host] { refresh_device_param_copy(*chunks, p, host, home_on_host); };
      if (host_work.empty()) {
        complete();
      } else {
        m_.launch_host_step_locked(set_index, [work = std::move(host_work)] {
          for (const CpuAdamWork& w : work) gx::cpu_adam_step(w.hyper, w.buffers);
        }, std::move(complete));
      }
      stats_.launch_seconds += seconds_since(t0);
    } else {
      for (Tier t : {Tier::kPinnedHost, Tier::kPageableHost})
        if (pc.shard_tiers().contains(t)) mgr.discard_copy(p, t);
      m_.unpin_all_locked();
      stats_.device_seconds += seconds_since(t0);
    }
  }
}

}  // namespace gx::torch_layer
