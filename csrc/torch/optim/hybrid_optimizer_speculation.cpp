// HybridOptimizer, part 2: the optimizer step started during backward (speculation).
//
// [Note: speculative CPU steps]
// A host set's CPU step needs its gradients (final once the set's chunk is reduced and sent to
// the host during backward) and what optimizer.step() decides: the hyperparameters, the
// clipping coefficient and the fp16 overflow skip, known only after backward. Waiting for them
// leaves the CPU idle through backward; this file guesses them instead, at the start of the
// backward pass: the hyperparameters of that moment and a multiplier of exactly 1 (no clipping,
// no loss scale). Python arms the guess only where it can hold: no fp16 loss scaler, and
// clipping off or the previous step's norm within max_norm.
// Each set's step then runs as soon as its gradients are on the host, out of place: it reads
// the master, m and v and writes their new values (and the new 16-bit parameters) into spare
// slots of the same pools, so the originals are untouched until step() judges the guess:
//   * right (the same hyperparameters for every group, a multiplier of exactly 1, the same
//     gradients and step counts as at launch): confirmed. When the set is settled (normally
//     by the next forward reaching it) the spares take the copies' place (a pointer exchange,
//     no copy) and the old slots become the next spares.
//   * wrong, or overtaken (another backward added gradients, a read or a placement change
//     settled the set before step(), zero_grad cleared them): the set is settled, its results
//     dropped, and step() steps it from the originals like any other set.
// Either way the parameters, moments and step counts equal the serial step's bit for bit. The
// price is host memory: one spare per speculated chunk (14 bytes per parameter with bf16 and an
// fp32 master), which Python only spends where the host has room. Where it has room for some
// sets' spares only, those whose gradients reach the host first (the back of the model) take
// them: their steps then run while the backward computes the rest, and step() steps the others.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/errors.h"
#include "torch/chunk_views.h"
#include "torch/optim/hybrid_optimizer.h"

namespace gx::torch_layer {

namespace {
struct CopyRange {
  const uint8_t* from;
  uint8_t* to;
  size_t bytes;
};

// The byte ranges of each output chunk's host shard that no run writes (`stepped`: ascending,
// disjoint element ranges), paired with the same ranges of its spare.
std::vector<CopyRange> unwritten_ranges(ChunkManager& mgr, Tier host, const std::map<ChunkId, void*>& spares,
                                        const std::vector<ChunkId>& outputs,
                                        const std::vector<std::pair<int64_t, int64_t>>& stepped) {
  std::vector<CopyRange> carry;
  for (ChunkId id : outputs) {
    const Chunk& c = mgr.chunk(id);
    const size_t item = element_size_bytes(c.dtype());
    const auto* from = static_cast<const uint8_t*>(c.shard_ptr(host));
    auto* to = static_cast<uint8_t*>(spares.at(id));
    int64_t at = 0;
    auto add = [&](int64_t b, int64_t e) {
      if (e > b) carry.push_back({from + b * item, to + b * item, static_cast<size_t>(e - b) * item});
    };
    for (const auto& [b, e] : stepped) {
      add(at, b);
      at = e;
    }
    add(at, c.shard_numel());
  }
  return carry;
}
}  // namespace

void HybridOptimizer::arm_spares(const std::vector<HyperValues>& groups, int64_t spare_allowance_bytes) {
  armed_ = groups;
  spare_allowance_bytes_ = static_cast<size_t>(spare_allowance_bytes);
}

void HybridOptimizer::arm_in_backward(const std::vector<HyperValues>& groups) {
  // Python refuses a backward that begins before step() completed the last one (optim/wrapper.py).
  GX_INTERNAL_ASSERT(stepped_in_backward_.empty(), "optimizer step in backward: armed while ",
                     stepped_in_backward_.size(), " chunk sets stepped during the previous backward wait for step()");
  armed_ = groups;
  armed_in_place_ = true;
  pipeline_.reset_host_step_seconds();  // this step's lanes' seconds count from here
}

size_t HybridOptimizer::spare_bytes_needed() const {
  size_t bytes = 0;
  if (rule_->steps_whole_sets()) return 0;  // never speculates
  for (const ChunkSet& set : sets_)
    if (set.trainable && set.spec.optim_on_host) bytes += spare_bytes_needed(set);
  return bytes;
}

size_t HybridOptimizer::spare_bytes_needed(const ChunkSet& set) const {
  std::vector<ChunkId> ids = set.spec.optimizer_chunks();
  ids.push_back(set.spec.param);
  size_t bytes = 0;
  for (ChunkId id : ids)
    if (id >= 0 && spares_.count(id) == 0) bytes += mgr_.chunk(id).shard_bytes();
  return bytes;
}

size_t HybridOptimizer::spare_bytes() const {
  size_t bytes = 0;
  for (const auto& [id, ptr] : spares_) bytes += mgr_.chunk(id).shard_bytes();
  return bytes;
}

void HybridOptimizer::release_spares() {
  for (const auto& [s, spec] : std::map<int, std::shared_ptr<Speculation>>(speculations_)) pipeline_.settle(s);
  for (const auto& [id, ptr] : spares_) mgr_.release_spare(id, mgr_.host_tier(), ptr);
  spares_.clear();
}

void HybridOptimizer::speculate(int set_index) {
  if (guessing_ && set_index >= 0) return guess(set_index);  // in place (hybrid_optimizer_in_place.cpp)
  if (!armed_ || set_index < 0) return;
  ChunkManager& mgr = mgr_;
  ChunkSet& set = sets_[static_cast<size_t>(set_index)];
  if (!set.trainable || !set.spec.optim_on_host || set.grad_place != GradPlace::kHost) return;
  if (pipeline_.pending(set_index) || speculations_.count(set_index) != 0) return;
  for (size_t k = 0; k < set.params.size(); ++k) {  // a parameter outside the armed groups: step() steps it
    const int group = group_of_param_[static_cast<size_t>(set.params[k])];
    if (set.has_grad[k] && group >= 0 && static_cast<size_t>(group) >= armed_->size()) return;
  }
  if (armed_in_place_) {
    step_in_backward(set_index);
    return;
  }
  const std::vector<PlannedRun> runs = runs_of(set, armed_->size());
  if (runs.empty()) return;
  const size_t fresh_spare_bytes = spare_bytes_needed(set);
  if (fresh_spare_bytes > spare_allowance_bytes_) return;  // beyond what this backward may spend: steps at step()
  const Tier host = mgr.host_tier();
  const bool has_master = set.spec.master >= 0;
  const ChunkId master_id = has_master ? set.spec.master : set.spec.param;
  std::vector<ChunkId> outputs{master_id};
  for (const auto& [kind, id] : set.spec.states) outputs.push_back(id);
  if (has_master) outputs.push_back(set.spec.param);  // the new 16-bit parameters
  for (ChunkId id : outputs) {
    if (spares_.count(id) != 0) continue;
    try {
      spares_[id] = mgr.allocate_spare(id, host);
    } catch (const OutOfMemoryError&) {
      return;  // no room for a double buffer: this set steps after backward
    }
  }
  spare_allowance_bytes_ -= fresh_spare_bytes;
  auto spare = [&](ChunkId id) { return static_cast<uint8_t*>(spares_.at(id)); };
  auto spec = std::make_shared<Speculation>();
  spec->has_grad = set.has_grad;
  spec->steps_before = set.step;
  spec->outputs = outputs;
  spec->new_steps = steps_after(set, runs);
  const RunViews originals = set_views(set, host, /*with_param16=*/false);  // read only: outputs go to spares
  std::vector<std::function<void()>> work;
  std::vector<std::pair<int64_t, int64_t>> stepped;  // element ranges of the shard the runs write
  for_each_run(set, runs, originals, [&](const PlannedRun& r, const RunViews& views) {
    const auto at = [&](ChunkId id) {
      return spare(id) + static_cast<size_t>(r.shard_begin) * element_size_bytes(mgr.chunk(id).dtype());
    };
    RunSpares out;
    out.master = at(master_id);
    for (const auto& [kind, id] : set.spec.states) out.states.push_back(at(id));
    if (has_master) {
      out.param16 = at(set.spec.param);
      out.param16_dtype = mgr.chunk(set.spec.param).dtype();
    }
    work.push_back(rule_->prepare_host_run(views, &out, r.step_after, (*armed_)[static_cast<size_t>(r.group)], 1.0));
    spec->host_params += r.shard_numel();
    stepped.emplace_back(r.shard_begin, r.shard_end);
  });
  // Elements no run writes (slots without a gradient, padding) are carried over into the spares
  // as they are: after the exchange the chunk holds exactly what an in-place step leaves.
  std::vector<CopyRange> carry = unwritten_ranges(mgr, host, spares_, outputs, stepped);
  std::shared_ptr<Event> grads_landed = mgr.copy_event(set.spec.grad);  // the D2H just started
  speculations_[set_index] = spec;
  launch_host_step(
      "spare step", set_index,
      [spec, grads_landed, work = std::move(work), carry = std::move(carry)] {
        for (const CopyRange& c : carry) std::memcpy(c.to, c.from, c.bytes);
        if (grads_landed) grads_landed->synchronize();
        for (const auto& run : work) run();
        spec->lifecycle.apply(EarlyStepEvent::kTaskStepped);
      },
      [this, set_index, spec] { finish_speculation(set_index, spec); },
      [spec] { return spec->confirmed.load(); });
}

void HybridOptimizer::finish_speculation(int set_index, const std::shared_ptr<Speculation>& spec) {
  auto it = speculations_.find(set_index);
  if (it != speculations_.end() && it->second == spec) speculations_.erase(it);
  // Needed before step() judged it (respond(): discarded): undone, which for spares is nothing to do.
  if (spec->lifecycle.state() != EarlyStepState::kJudged) spec->lifecycle.apply(EarlyStepEvent::kUndo);
  if (!spec->confirmed) {
    dropped_total_ += 1;
    return;  // the originals are untouched; step() steps the set from them
  }
  ChunkManager& mgr = mgr_;
  const Tier host = mgr.host_tier();
  ChunkSet& set = sets_[static_cast<size_t>(set_index)];
  for (ChunkId id : spec->outputs) {
    if (mgr.in_flight(id)) mgr.wait(id);  // a fetch may still read P's old host copy
    spares_[id] = mgr.exchange_copy(id, host, spares_.at(id));
  }
  refresh_device_param_copy(mgr, set.spec.param, host, set.spec.param_home_on_host);
  confirmed_total_ += 1;
}

void HybridOptimizer::step_in_backward(int set_index) {
  ChunkManager& mgr = mgr_;
  ChunkSet& set = sets_[static_cast<size_t>(set_index)];
  GX_INTERNAL_ASSERT(stepped_in_backward_.count(set_index) == 0, "optimizer step in backward: chunk set ", set_index,
                     " sent gradients to the host twice before optimizer.step() (a second backward is refused when "
                     "it begins)");
  if (mgr.in_flight(set.spec.param)) mgr.wait(set.spec.param);  // a fetch may still read P's host copy
  auto life = std::make_shared<EarlyStepLifecycle>();
  stepped_in_backward_[set_index] = life;
  backward_stats_.guessed_sets += 1;  // final: step() confirms it (respond(): nothing undoes it)
  step_set(set_index, *armed_, 1.0, backward_stats_, mgr.copy_event(set.spec.grad), life);
}

std::set<int> HybridOptimizer::judge_speculations(const std::vector<HyperValues>& groups, double grad_multiplier) {
  std::set<int> confirmed;
  if (armed_in_place_ || !stepped_in_backward_.empty()) {
    // Python checked the promise before this call (optim/wrapper.py): other values here are a bug.
    if (!stepped_in_backward_.empty())
      verdict_for(EarlyMode::kInBackward, true, armed_ && *armed_ == groups, grad_multiplier);  // kConfirm
    for (const auto& [s, life] : stepped_in_backward_) {
      life->apply(EarlyStepEvent::kJudge);  // its task may still run: judged early, final when it ends
      confirmed.insert(s);
    }
    stepped_in_backward_.clear();
    armed_.reset();
    armed_in_place_ = false;
    return confirmed;
  }
  const bool same_hyper = armed_.has_value() && *armed_ == groups;
  armed_.reset();
  for (const auto& [s, spec] : std::map<int, std::shared_ptr<Speculation>>(speculations_)) {
    const ChunkSet& set = sets_[static_cast<size_t>(s)];
    const bool same_inputs = set.grad_place == GradPlace::kHost && set.spec.optim_on_host &&
                             set.has_grad == spec->has_grad && set.step == spec->steps_before;
    // A set needed before step() was settled, and so undone and forgotten, then: every one here is judged.
    const EarlyVerdict verdict = verdict_for(EarlyMode::kSpares, same_inputs, same_hyper, grad_multiplier);
    spec->confirmed = verdict == EarlyVerdict::kConfirm;  // read by the pipeline's eager check
    spec->lifecycle.apply(EarlyStepEvent::kJudge);
    if (verdict == EarlyVerdict::kConfirm) {  // committed when settled
      ChunkSet& mutable_set = sets_[static_cast<size_t>(s)];
      for (const auto& [k, step] : spec->new_steps) mutable_set.step[k] = step;
      stats_.host_params += spec->host_params;
      stats_.guessed_sets += 1;
      confirmed.insert(s);
    } else {
      pipeline_.settle(s);  // waits for it; unconfirmed, its results are dropped
      stats_.guessed_sets += 1;  // started during backward, and stepped again below
      stats_.redone_sets += 1;
    }
  }
  return confirmed;
}

}  // namespace gx::torch_layer
