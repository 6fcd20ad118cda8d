// GeminiManager, the optimizer: attaching it (its state chunks get memory), its step and norm,
// and the optimizer pipeline. Host sets' CPU optimizer steps run on a background thread in
// forward order while the caller goes on (zero_grad, the next batch, the next forward); each set
// is settled (its step waited for, P's other copy made coherent) the first time something needs
// its chunks (core/optimizer_pipeline.h). The step itself is torch/optim/hybrid_optimizer.cpp;
// every entry point below holds the lock.
#include <map>

#include "core/errors.h"
#include "core/memory_resource.h"
#include "torch/manager/manager.h"

namespace gx::torch_layer {

void GeminiManager::settle_all() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  settle_all_locked();
}

size_t GeminiManager::pending_steps() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  return pipeline_.pending_count();
}

void GeminiManager::refresh_forward_order_locked() {
  std::vector<int>& order = forward_order_.sets;
  order.clear();
  std::vector<uint8_t> seen(sets_.size(), 0);
  for (ChunkId c : trace_.recorded()) {
    const int s = set_of_chunk(c);
    if (s < 0 || seen[static_cast<size_t>(s)]) continue;
    seen[static_cast<size_t>(s)] = 1;
    order.push_back(s);
  }
  for (size_t s = 0; s < sets_.size(); ++s)
    if (!seen[s]) order.push_back(static_cast<int>(s));
  forward_order_.rank.assign(sets_.size(), 0);
  for (size_t k = 0; k < order.size(); ++k)
    forward_order_.rank[static_cast<size_t>(order[k])] = static_cast<int64_t>(k);
}

void GeminiManager::hold_optimizer_thread(bool hold) { pipeline_.hold(hold); }

void GeminiManager::set_optimizer_task_delay_us(int64_t delay_us) { pipeline_.set_task_delay_us(delay_us); }

// --- the optimizer's entry points ---------------------------------------------------------------

void GeminiManager::attach_optimizer(std::unique_ptr<OptimizerRule> rule, std::vector<int> group_of_param,
                                     const std::vector<std::vector<ChunkId>>& state_chunks) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  GX_CHECK(!optimizer_, "attach_optimizer: this manager has an optimizer already; there can be only one.");
  try {
    allocate_state_chunks_locked(rule->state_kinds(), state_chunks);
    auto opt = std::make_unique<HybridOptimizer>(*ctx_, mgr_, sets_, grad_sq_, params_, residency_, pipeline_,
                                                 forward_order_, std::move(rule));
    opt->set_param_groups(std::move(group_of_param));
    optimizer_ = std::move(opt);
  } catch (...) {
    for (auto& set : sets_) {
      for (const auto& [kind, id] : set.spec.states)
        for (Tier t : {Tier::kDevice, Tier::kPinnedHost, Tier::kPageableHost})
          if (mgr_.chunk(id).shard_tiers().contains(t)) mgr_.discard_copy(id, t);
      set.spec.states.clear();
    }
    throw;
  }
}

void GeminiManager::allocate_state_chunks_locked(const std::vector<StateKind>& kinds,
                                                 const std::vector<std::vector<ChunkId>>& state_chunks) {
  GX_CHECK(state_chunks.size() == sets_.size(), "attach_optimizer: expected state chunks for ", sets_.size(),
           " chunk sets, got ", state_chunks.size(), ".");
  for (size_t s = 0; s < sets_.size(); ++s) {
    const ChunkSet& set = sets_[s];
    const size_t expected = set.trainable ? kinds.size() : 0;
    GX_CHECK(state_chunks[s].size() == expected, "attach_optimizer: chunk set ", s, " needs ", expected,
             " state chunks, got ", state_chunks[s].size(), ".");
    GX_INTERNAL_ASSERT(set.spec.states.empty(), "chunk set ", s, " has optimizer state before an optimizer");
    for (ChunkId id : state_chunks[s]) {
      check_companion_layout(set.spec.param, id);
      GX_INTERNAL_ASSERT(mgr_.chunk(id).shard_tiers().empty(), "state chunk ", id, " has memory before its optimizer");
    }
  }
  settle_all_locked();
  const Tier host = mgr_.host_tier();
  auto tier_of = [&](size_t s) { return sets_[s].spec.optim_on_host ? host : Tier::kDevice; };
  // Kind by kind: each kind's copies on a tier come from one arena reservation (as finalize()
  // does per group), so a kind that later leaves a tier leaves a wholly free extent.
  for (size_t k = 0; k < kinds.size(); ++k) {
    std::map<Tier, size_t> bytes;
    for (size_t s = 0; s < sets_.size(); ++s)
      if (k < state_chunks[s].size())
        bytes[tier_of(s)] += round_up(mgr_.chunk(state_chunks[s][k]).shard_bytes(), kResourceAlignmentBytes);
    for (const auto& [tier, n] : bytes)
      if (tier != Tier::kDevice) mgr_.reserve_arena(tier, n);  // device room is the budget's: see below
    for (size_t s = 0; s < sets_.size(); ++s) {
      if (k >= state_chunks[s].size()) continue;
      const ChunkId id = state_chunks[s][k];
      const Tier tier = tier_of(s);
      if (tier == Tier::kDevice) {
        residency_.with_space_for(id, [&] { mgr_.allocate_copy(id, tier); });
      } else {
        mgr_.allocate_copy(id, tier);
      }
      sets_[s].spec.states.emplace_back(kinds[k], id);  // before zeroing: a failure releases what is listed
      shard_view(*ctx_, mgr_, id, tier).zero_();
    }
  }
}

HybridOptimizer& GeminiManager::optimizer_locked() {
  GX_CHECK(optimizer_, "the engine has no optimizer yet: create it with engine.optimizer(...) first.");
  return *optimizer_;
}

double GeminiManager::grad_norm_sq() {
  std::lock_guard<OwnedMutex> lock(mutex_);
  HybridOptimizer& opt = optimizer_locked();
  flush_grads_locked();  // gradients accumulated under no_sync count too
  return opt.grad_norm_sq();
}

void GeminiManager::optimizer_step(const std::vector<HyperValues>& groups, double grad_multiplier) {
  std::lock_guard<OwnedMutex> lock(mutex_);
  HybridOptimizer& opt = optimizer_locked();
  flush_grads_locked();
  drop_whole_cache_locked();  // the values change
  opt.step(groups, grad_multiplier);
  // CPU steps still running: their parameters refuse access until each set is settled.
  for (int s : pipeline_.pending_sets()) storages_->set_stepping(sets_[static_cast<size_t>(s)].spec.param, true);
}

}  // namespace gx::torch_layer
