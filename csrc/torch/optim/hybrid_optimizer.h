// HybridOptimizer: the optimizer step over chunk sets, a rule's CPU kernel where the state is on
// the host and its device kernel where it is on the device (optimizer_rule.h; Adam is one rule).
//
// A component of the GeminiManager: it receives what it works on (the chunk manager, the chunk
// sets and parameters, residency, the optimizer pipeline, the forward order and the device
// context) as Residency does, has no lock of its own, and is reached only under the manager's
// lock (GeminiManager::optimizer_step, grad_norm_sq and with_optimizer).
//
// Design note.
//  * Units of work. Within a chunk set, consecutive slots that have a gradient, belong to the
//    same parameter group and have taken the same number of steps form one run; a run is one
//    kernel call over its element range (alignment padding between slots included: it is zero in
//    every companion and stays zero). Slots without a gradient are skipped, exactly as
//    torch.optim skips a parameter whose grad is None, and keep their own step count.
//  * Host sets: the rule's CPU kernel reads the fp32 master, its states and the 16-bit (or fp32)
//    gradient from the pinned host copies and writes master, states and the 16-bit parameter
//    into P's host copy in one pass. P's device copy is then refreshed by one H2D copy (home on
//    the device) or dropped (home on the host).
//  * Device sets: the rule's device kernel on the device copies, then the master is rounded into
//    P's device copy; a stale host copy of P is dropped.
//  * Host sets run on the manager's optimizer thread, in forward order, and step() returns
//    before they finish (torch/manager/manager_optimizer.cpp; the Note in step() says why this is exact).
//    GeminiConfig.overlap_optimizer=False settles each one before step() returns.
//  * The link lane. Host sets named by set_link_sets (the placement policy chooses them from
//    measured rates) are stepped by the rule's device kernel reading and writing their pinned
//    host copies in place over the link (torch/mapped_view.h), on the pipeline's second thread,
//    while the CPU kernel steps the other host sets: the host's memory bandwidth is shared
//    by the two, not divided. The kernels compute the same bits, so which lane steps a set
//    changes nothing but time; everything else (settling, P's refresh) is as for a CPU step.
//    On sim the lane runs the same CPU arithmetic on its thread.
//  * `grad_multiplier` folds 1/loss_scale and the clipping coefficient into one factor applied
//    to every gradient, so clipping costs no extra pass.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/chunk_manager.h"
#include "core/chunk_set.h"
#include "core/optimizer_pipeline.h"
#include "core/residency.h"
#include "core/early_step.h"
#include "torch/chunk_views.h"
#include "torch/optim/optimizer_rule.h"

namespace gx::torch_layer {

RunViews narrow_run(const RunViews& set, int64_t begin, int64_t n);  // one run's elements of a set's views

// After a host step wrote P's host copy: P's device copy, if any, is refreshed from it (home on
// the device) or dropped (home on the host).
void refresh_device_param_copy(ChunkManager& mgr, ChunkId p, Tier host, bool home_on_host);

struct StepStats {
  int64_t host_params = 0;    // elements stepped by the CPU kernel in the last step
  int64_t link_params = 0;    // host-resident elements stepped by the device kernel over the link
  int64_t device_params = 0;  // elements stepped by the device kernel
  double host_seconds = 0.0;  // CPU kernel time on the optimizer thread of the sets settled so far
  double link_seconds = 0.0;  // the link lane's time (launch to the kernels' end) of the sets settled so far
  double launch_seconds = 0.0;  // time step() spent preparing and handing over the host sets
  double device_seconds = 0.0;  // host time to launch (device kernels run asynchronously)
  int64_t pending_sets = 0;     // host sets whose step has not been settled yet
  // This step's host sets whose step started during the backward before it, in whichever form
  // (in place, into spares, the step in backward): all of them; of those, the in-place ones
  // corrected (the multiplier was not 1), those stepped again at step() (the hyperparameters
  // changed, or spares dropped), and those left alone (a non-finite gradient).
  int64_t guessed_sets = 0;
  int64_t corrected_sets = 0;
  int64_t redone_sets = 0;
  int64_t skipped_sets = 0;
  double correction_seconds = 0.0;  // the corrective passes' time on the optimizer thread so far
};

class HybridOptimizer {
 public:
  // grad_sq: per set, the squared norm of G taken on the device when G left for the host
  // (undefined: none taken, or G changed since); the manager keeps it.
  HybridOptimizer(DeviceContext& ctx, ChunkManager& mgr, std::vector<ChunkSet>& sets,
                  const std::vector<at::Tensor>& grad_sq, const std::vector<ParamSpec>& params, Residency& residency,
                  OptimizerPipeline& pipeline, const ForwardOrder& order, std::unique_ptr<OptimizerRule> rule);
  ~HybridOptimizer();
  // Parameter group of each parameter (-1: not in the optimizer; never stepped).
  void set_param_groups(std::vector<int> group_of_param);
  // Sum of squares of every gradient held in G chunks, in fp32 (waits for gradient moves), over
  // every rank when sharded.
  double grad_norm_sq();
  // One set of hyperparameters per parameter group (steps are counted per parameter, and
  // `grad_multiplier` applies to every gradient).
  void step(const std::vector<HyperValues>& groups, double grad_multiplier);
  StepStats last_step() const;  // settles nothing: host_seconds covers the sets settled so far
  // The host sets the link lane steps from the next step on (set indices; others: the CPU). A
  // set whose state is on the device, or a rule without a native device kernel, ignores it.
  void set_link_sets(const std::vector<int>& sets);
  std::vector<int> link_sets() const { return {link_sets_.begin(), link_sets_.end()}; }

  // A backward pass begins: the early-step policy (core/early_step.h) decides from `facts`, to
  // which this adds what the optimizer knows itself (the rule's abilities, the spare bytes), and
  // the host sets' steps are armed accordingly with `groups`, the hyperparameters of this moment:
  //  * spares (hybrid_optimizer_speculation.cpp): each host set's step starts as soon as its
  //    gradients leave for the host, out of place into spare slots, for the sets whose new spares
  //    fit the decision's allowance (those whose gradients arrive first); step() confirms it (the
  //    spares take the copies' place when the set is settled) or drops it and steps the set again
  //    from the untouched originals. Spares (master, states and P's host copy per set) stay
  //    allocated between steps: a double buffer of the host optimizer state.
  //  * in place (hybrid_optimizer_in_place.cpp): each host set is stepped in place, with a
  //    multiplier of 1, as soon as its gradients are on the host; step() confirms, corrects, or
  //    undoes and redoes it.
  //  * in backward: each host set's step runs in place, as step() would run it, with a
  //    multiplier of 1, and step() leaves those sets alone. Nothing to undo: Python arms it only
  //    where the caller promised what makes it final (no clipping or loss scaling, one backward per
  //    step, the hyperparameters unchanged until step()), and step() refuses other values as a bug.
  EarlyStepDecision backward_started(const std::vector<HyperValues>& groups, EarlyStepFacts facts);
  int64_t sets_stepped_in_backward() const { return static_cast<int64_t>(stepped_in_backward_.size()); }
  bool armed() const { return armed_.has_value(); }
  size_t spare_bytes_needed() const;  // to speculate on every host set, beyond the spares held
  size_t spare_bytes_needed(const ChunkSet& set) const;  // to speculate on this set, likewise
  size_t spare_bytes() const;
  void release_spares();
  int64_t speculations_confirmed() const { return confirmed_total_; }
  int64_t speculations_dropped() const { return dropped_total_; }
  // A host set's gradients left for the host (the manager calls it): its step may start now.
  void speculate(int set_index);

  // An event: the backward's gradients are complete (the manager flushes the rest to their tier,
  // for the norm or the step). Sets whose gradients land from now on step at step(), not early.
  void gradients_complete() { guessing_ = false; }
  // zero_grad(): guesses not yet judged are undone (their gradients are dropped).
  void grads_cleared();
  // Reads between backward and step() (see [Note: reading a guessed set]). The sets whose guess
  // stays while a read is served: their tasks are waited for, not settled (empty when sharded).
  std::set<int> wait_guesses_for_read();
  // `out` holds a copy of `chunk`'s slot `slot` (any dtype and device): where the set's unjudged
  // guess stepped it, its values before the guess are written into it instead. True if so.
  bool read_before_guess(int set_index, ChunkId chunk, size_t slot, at::Tensor& out);
  int64_t reads_before_guesses() const { return reads_before_guesses_; }
  int64_t guesses_undone() const { return undone_total_; }
  int64_t guesses_judged() const { return judged_total_; }
  int64_t guesses_corrected() const { return corrected_total_; }  // or undone and redone at step()
  const EarlyStepPolicy& early_step_policy() const { return policy_; }
  EarlyStepPolicy& early_step_policy() { return policy_; }
  // Whether the rule corrects its in-place step for every host set's dtypes (no side effects).
  bool guess_supported() const;

 private:
  struct Speculation {
    std::vector<uint8_t> has_grad;                        // as launched: verified by step()
    std::vector<int64_t> steps_before;                    // per slot
    std::vector<std::pair<size_t, int64_t>> new_steps;    // slot -> step count once confirmed
    std::vector<ChunkId> outputs;                         // chunks whose host copy a spare replaces
    int64_t host_params = 0;
    EarlyStepLifecycle lifecycle;         // core/early_step.h: stepped, then judged or (needed before step()) undone
    std::atomic<bool> confirmed{false};   // the verdict kConfirm: the spares take the copies' place when settled
  };
  // The set's runs (core/early_step.h plan_runs), cut at this rank's shard.
  std::vector<PlannedRun> runs_of(const ChunkSet& set, size_t num_groups) const;
  // One run's views (narrow_run) stamped with its stochastic-rounding stream: the key of
  // `step` for the set's parameter chunk and the chunk-wide index of its first element.
  RunViews run_views(const RunViews& whole, const ChunkSet& set, int64_t begin, int64_t n, int64_t step) const;
  // The one walk of a set's runs, for the serial step and every early mode: `fn` gets each run
  // that has elements in this rank's shard with its views (run_views of `whole`); a run in other
  // ranks' shards only advances its step counts.
  void for_each_run(const ChunkSet& set, const std::vector<PlannedRun>& runs, const RunViews& whole,
                    const std::function<void(const PlannedRun&, const RunViews&)>& fn) const;
  // The step count each stepped slot of `runs` takes (slot, count).
  static std::vector<std::pair<size_t, int64_t>> steps_after(const ChunkSet& set, const std::vector<PlannedRun>& runs);
  // The set's chunks as views of this rank's shards on `tier`, made once per set; runs narrow them.
  RunViews set_views(const ChunkSet& set, Tier tier, bool with_param16) const;
  // `grads_landed`: the host steps wait for it first (the gradients' copy to the host, still in
  // flight when the step starts during backward); the set's figures go to `stats`.
  // `life`: a step in backward's lifecycle, told when the set's runs are done (kTaskStepped).
  void step_set(int set_index, const std::vector<HyperValues>& groups, double grad_multiplier, StepStats& stats,
                std::shared_ptr<Event> grads_landed = nullptr, std::shared_ptr<EarlyStepLifecycle> life = nullptr);
  // A whole-set rule's step of one set in the caller's thread, then P rewritten from the master.
  void step_whole_set(int set_index, const std::vector<PlannedRun>& runs, double grad_multiplier);
  void prepare_device_set(ChunkSet& set);  // P and G on the device, pinned, for the device kernel
  void ready_set(ChunkSet& set);           // a host set's gradients are on the host; a device set prepared
  void finish_device_set(ChunkSet& set);   // P's stale host copies dropped, pins released
  // The arming of each early mode (backward_started).
  void arm_spares(const std::vector<HyperValues>& groups, int64_t spare_allowance_bytes);
  void arm_guess(const std::vector<HyperValues>& groups);
  void arm_in_backward(const std::vector<HyperValues>& groups);
  void finish_speculation(int set_index, const std::shared_ptr<Speculation>& spec);
  void step_in_backward(int set_index);  // arm_in_backward: the set's step as step() runs it, started now
  struct Guess;
  void guess(int set_index);  // arm_guess: the set's step in place, started now
  void finish_guess(int set_index, const std::shared_ptr<Guess>& g);  // when the set is settled
  // step(): each guess confirmed, corrected, or undone and stepped again; returns their sets.
  std::set<int> judge_guesses(const std::vector<HyperValues>& groups, double grad_multiplier);
  void settle_guesses();  // every unjudged guess undone
  std::set<int> judge_speculations(const std::vector<HyperValues>& groups, double grad_multiplier);
  // Hands a host set's step to the pipeline with its forward position as priority; `what` names
  // its range ("step", "guess", "spare step", "correction").
  void launch_host_step(const char* what, int set_index, std::function<void()> compute, std::function<void()> complete,
                        std::function<bool()> eager = nullptr, StepLane lane = StepLane::kCpu);
  // One run of a link-lane set: the rule's device kernel over mapped views of its host views.
  std::function<void()> link_run(const RunViews& host, int64_t step, const HyperValues& hyper,
                                 double grad_multiplier) const;
  // The link lane's task: the runs on a stream of its own, waited for (on sim: the runs).
  std::function<void()> link_task(std::vector<std::function<void()>> runs) const;
  void wait_grads();                    // gradient moves still in flight finish
  double all_reduce_sum(double local);  // over the ranks (sharded; itself otherwise)

  DeviceContext& ctx_;
  ChunkManager& mgr_;
  std::vector<ChunkSet>& sets_;
  const std::vector<at::Tensor>& grad_sq_;
  const std::vector<ParamSpec>& params_;
  Residency& residency_;
  OptimizerPipeline& pipeline_;
  const ForwardOrder& order_;
  std::shared_ptr<OptimizerRule> rule_;  // shared with link-lane tasks in flight
  std::set<int> link_sets_;
  std::optional<std::vector<HyperValues>> armed_;
  size_t spare_allowance_bytes_ = 0;  // new spare bytes this backward's speculations may still take
  bool armed_in_place_ = false;
  // This backward's in-place steps (arm_in_backward) and their lifecycles, until step() judges them.
  std::map<int, std::shared_ptr<EarlyStepLifecycle>> stepped_in_backward_;
  StepStats backward_stats_;           // their figures, added to the step's
  std::map<int, std::shared_ptr<Speculation>> speculations_;  // by set index, this backward's
  std::map<ChunkId, void*> spares_;                           // host spare slot per chunk
  bool guessing_ = false;                                     // arm_guess: this backward's sets step in place
  std::shared_ptr<const std::vector<HyperValues>> guess_groups_;  // the hyperparameters they use
  std::map<int, std::shared_ptr<Guess>> guesses_;             // by set index, until judged or undone
  EarlyStepPolicy policy_;
  struct GuessCounts {  // written by the optimizer thread's tasks
    std::atomic<int64_t> skipped{0};
    std::atomic<int64_t> correction_ns{0};
  };
  std::shared_ptr<GuessCounts> guess_counts_ = std::make_shared<GuessCounts>();  // the last armed step's
  int64_t undone_total_ = 0;
  int64_t reads_before_guesses_ = 0;  // reads served with values recomputed from below a guess
  int64_t judged_total_ = 0;
  int64_t corrected_total_ = 0;
  int64_t confirmed_total_ = 0;
  int64_t dropped_total_ = 0;
  std::vector<int> group_of_param_;
  StepStats stats_;
};

}  // namespace gx::torch_layer
