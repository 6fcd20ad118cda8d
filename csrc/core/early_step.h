// EarlyStep: when each host chunk set's optimizer step starts, and what becomes of a step that
// started before optimizer.step() knew all of its inputs.
//
// Design note. A host set's CPU step needs its gradients, final once they are on the host during
// backward, and what optimizer.step() decides only afterwards: the gradients' multiplier (the
// clipping coefficient, 1/loss_scale) and the hyperparameters. Started at step() the CPU idles
// through backward; started during backward it must guess those. Each backward takes one mode:
//   kAtStep      optimizer.step() starts the set's step (it may still finish during the next
//                forward: GeminiConfig.overlap_optimizer).
//   kSpares      during backward, out of place into spare copies of the set's host chunks,
//                guessing a multiplier of 1 and the backward's hyperparameters. step() confirms
//                (the spares become the copies) or drops the results and steps again from the
//                untouched originals: exact either way, at the price of host memory.
//   kInPlace     during backward, in place, with the same guess. step() confirms, corrects (the
//                multiplier was below 1: one corrective pass), or redoes (other hyperparameters:
//                undo, then the step with them); a set needed before step() is undone.
//   kInBackward  during backward, in place and final: the caller promised that nothing the step
//                depends on changes before step() (GeminiConfig.optimizer_step_in_backward).
// EarlyStepPolicy::decide reads the facts the optimizer gathered at the backward's start
// (EarlyStepFacts) and returns the mode, how many host sets it covers and why, top to bottom in
// one ladder. It remembers what the steps so far showed: the in-place guess is not taken after a
// clipped step (it would be corrected), and only on the backward expected to be the last of a
// gradient accumulation (the others would be undone by the next).
// Every early mode shares one lifecycle per set (EarlyStepState, next_early_state) and one set of
// verdicts (verdict_for), and one answer to whatever happens between backward and step(): another
// backward, a read, zero_grad, ... (respond, with its table below). Every step, early or not,
// walks the set's runs (plan_runs).
// Decision code only: the optimizer (torch/optim) gathers the facts and does the work.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace gx {

// When the host sets step, as configured (GeminiConfig.host_steps and its aliases).
enum class HostSteps : int8_t {
  kSerial,      // at step(), settled before step() returns (overlap_optimizer=False)
  kAtStep,      // at step(), finishing during the next forward
  kSpares,      // during backward where the guess can hold, out of place
  kInPlace,     // during backward where the guess can hold, in place (spares where the rule cannot correct)
  kInBackward,  // during backward, final
};
enum class EarlyMode : int8_t { kAtStep, kSpares, kInPlace, kInBackward };
// The host sets whose step starts during this backward.
enum class EarlyCover : int8_t { kNone, kSomeSets, kEverySet };

const char* to_string(HostSteps h);  // the config's spelling: "serial", "at_step", "spares", ...
const char* to_string(EarlyMode m);  // "at_step", "spares", "in_place", "in_backward"
const char* to_string(EarlyCover c);  // "none", "some sets", "every set"
HostSteps host_steps_from(const std::string& name);  // UsageError naming the choices

// What the optimizer knows when a backward begins.
struct EarlyStepFacts {
  HostSteps configured = HostSteps::kInPlace;
  std::string optimizer_name = "the optimizer";
  bool rule_native = true;              // the rule has kernels of its own (else its step() runs in step())
  bool rule_steps_whole_sets = false;   // the rule steps whole sets at once: nothing to start per run
  bool rule_corrects_in_place = false;  // the rule corrects its in-place step for every host set's dtypes
  bool loss_scaled = false;             // an fp16 loss scaler divides the gradients
  double max_norm = 0.0;                // clipping at step() (0: off)
  bool user_clipped_last = false;       // engine.clip_grad_norm_ scaled the last step's gradients
  std::optional<double> last_norm;      // the last step's global gradient norm, where one was taken
  bool placement_decides_now = false;   // this iteration's end decides the placement: the chunks move
  // Spares: the host's available bytes (none: unreadable), the spare bytes held, and the new
  // spare bytes the host sets need: the fewest any one set needs (none: no host set) and all.
  std::optional<int64_t> host_available_bytes;
  int64_t spare_bytes_held = 0;
  std::optional<int64_t> spare_bytes_least;
  int64_t spare_bytes_all = 0;
};

struct EarlyStepDecision {
  EarlyMode mode = EarlyMode::kAtStep;
  EarlyCover cover = EarlyCover::kNone;
  int64_t spare_allowance_bytes = 0;          // kSpares: new spare bytes this backward's sets may take
  std::optional<EarlyCover> planned_cover;    // the cover the next iterations plan for, where it differs
  std::string reason;
};

class EarlyStepPolicy {
 public:
  // A backward pass begins: counted toward the next step, then the decision for it.
  EarlyStepDecision decide(const EarlyStepFacts& facts);
  // optimizer.step() ran with this multiplier (1: a guess of "no scaling" held).
  void step_taken(double grad_multiplier);
  void grads_cleared();  // zero_grad() without a step since the last backward

  // What the next decisions depend on, for checkpoints: a run resumed from one decides as the run
  // that wrote it would have (and so computes the same bits).
  struct Memory {
    int64_t backwards_per_step = 0;
    bool last_step_scaled = false;
  };
  Memory memory() const { return {backwards_per_step_, last_step_scaled_}; }
  void restore(const Memory& m);  // UsageError for a negative backwards_per_step

  int64_t backwards_expected() const { return backwards_per_step_ > 0 ? backwards_per_step_ : 1; }
  int64_t steps_taken() const { return steps_; }
  int64_t steps_scaled() const { return steps_scaled_; }  // multiplier below 1 (clipped)

 private:
  // kInPlace, the rule correcting: the guess is taken unless the history says it will not hold.
  EarlyStepDecision decide_in_place(const EarlyStepFacts& facts) const;
  // kSpares (and kInPlace where the rule cannot correct): where the norm stayed within max_norm
  // and the host holds spares, for as many host sets as half of its available memory holds.
  static EarlyStepDecision decide_spares(const EarlyStepFacts& facts);

  int64_t backwards_this_step_ = 0;
  int64_t backwards_per_step_ = 0;  // as the last step saw it (0: no step yet)
  bool last_step_scaled_ = false;
  int64_t steps_ = 0;
  int64_t steps_scaled_ = 0;
};

// The lifecycle of one set's step started during backward, shared by every early mode:
//   kStepping    -> kStepped      the task stepped every run (in place, or into the spares)
//   kStepping    -> kSkipped      the task found a non-finite gradient and wrote nothing (in place:
//                                 a non-finite value could not be taken back out of the moments)
//   kStepping    -> kJudgedEarly  step() gave its verdict while the task ran: the task runs the
//                                 verdict's work itself when it ends
//   kJudgedEarly -> kJudged       the task ended and ran the verdict's work
//   kStepped     -> kJudged       step() judged it after the task ended: step() runs the work
//   kSkipped     -> kJudged       likewise (the verdict's work for a set left as it was)
//   kStepped     -> kUndone       the set was needed before step() judged it (another backward
//                                 adds to its gradients, zero_grad, a placement change): undone
//                                 in place, or its spares dropped
//   kSkipped     -> kUndone       likewise, with nothing to undo
// kJudged and kUndone are final; anything else is a bug (InternalError).
enum class EarlyStepState : int8_t { kStepping, kStepped, kSkipped, kJudgedEarly, kJudged, kUndone };
enum class EarlyStepEvent : int8_t { kTaskStepped, kTaskSkipped, kJudge, kUndo };

const char* to_string(EarlyStepState s);
const char* to_string(EarlyStepEvent e);
EarlyStepState next_early_state(EarlyStepState from, EarlyStepEvent event);  // InternalError if illegal

// One set's lifecycle, shared between the optimizer thread and the caller's (its own mutex).
class EarlyStepLifecycle {
 public:
  EarlyStepState apply(EarlyStepEvent event);  // returns the state before the event
  EarlyStepState state() const;

 private:
  mutable std::mutex mutex_;
  EarlyStepState state_ = EarlyStepState::kStepping;
};

// What step() does with a set stepped during backward.
enum class EarlyVerdict : int8_t {
  kConfirm,  // the guess held: nothing more to compute (spares: they become the copies)
  kCorrect,  // in place, the multiplier below 1: one corrective pass
  kRedo,     // in place, other hyperparameters: undo, then the step with them
  kDrop,     // the inputs changed (or spares that did not hold): undone or dropped, stepped at step()
};
const char* to_string(EarlyVerdict v);

// At step(): `same_inputs`, the set's gradients and step counts are those the task used;
// `same_hyper`, step()'s hyperparameters are the guessed ones; `grad_multiplier`, step()'s.
// InternalError for kAtStep, and for kInBackward where the promise did not hold (the caller
// refuses that before step() runs).
EarlyVerdict verdict_for(EarlyMode mode, bool same_inputs, bool same_hyper, double grad_multiplier);

// What can happen to a set stepped early before step() judges it, and what becomes of its early
// step. Every mode answers every interruption (respond); the table, mode by mode:
//
//   interruption       at_step          spares           in_place                    in_backward
//   another backward   nothing started  discarded        discarded                   refused
//   read, checkpoint   nothing started  discarded        served before (sharded:     final
//                                                        discarded)
//   zero_grad          nothing started  discarded        discarded                   refused
//   placement change   nothing started  discarded        discarded                   final
//   other hyper.       nothing started  discarded        judged at step (redo)       refused
//   scaled step        nothing started  discarded        judged at step (correct)    refused
//   non-finite grad    nothing started  judged at step   skipped by the task         final
//
// Where the change is known when the backward begins the early step is not taken at all
// (EarlyStepPolicy::decide: the placement deciding at this iteration's end, accumulation before
// the last backward, the last step scaled).
enum class Interruption : int8_t {
  kAnotherBackward,  // a further backward adds to the set's gradients (accumulation)
  kRead,             // its parameters or optimizer state are read (a parameter's value, state_dict)
  kCheckpoint,       // a checkpoint saves them (a read of every set)
  kZeroGrad,         // zero_grad() clears its gradients
  kPlacementChange,  // the placement moves its chunks
  kHyperChange,      // step() runs with other hyperparameters than the backward's
  kScaledStep,       // step()'s gradient multiplier is not 1 (clipping)
  kNonFiniteGrad,    // its gradients hold an inf or a NaN
};
enum class EarlyResponse : int8_t {
  kNothingStarted,  // at_step: no set stepped before step()
  kJudgedAtStep,    // the early step stays; step() gives its verdict (verdict_for)
  kServedBefore,    // the early step stays; the read gets the values before it (the rule's undo on copies)
  kDiscarded,       // undone in place, or its spares dropped: step() steps the set like any other
  kSkippedByTask,   // the task found the gradients non-finite and wrote nothing: step() steps the set
  kFinal,           // in backward: the step is final (reads show the stepped values)
  kRefused,         // in backward: the promise that made it final is broken: an error naming the fix
};
const char* to_string(Interruption i);
const char* to_string(EarlyResponse r);
EarlyResponse respond(EarlyMode mode, Interruption what, bool sharded);

// One kernel call of a set's step: consecutive slots that have a gradient, belong to the same
// parameter group and have taken the same number of steps, with the elements that lie in this
// rank's shard (offsets into the shard; none where shard_end <= shard_begin: only the step
// count advances). Alignment padding between slots is included: zero in every companion chunk.
struct PlannedRun {
  size_t first_slot = 0;
  size_t last_slot = 0;
  int group = 0;
  int64_t step_after = 0;  // the slots' step count once stepped
  int64_t shard_begin = 0;
  int64_t shard_end = 0;
  int64_t shard_numel() const { return shard_end > shard_begin ? shard_end - shard_begin : 0; }
};

struct SlotExtent {
  int64_t offset = 0;  // elements from the chunk's start
  int64_t numel = 0;
};

// The runs of one set. Per slot: whether it has a gradient, its group (-1: in no optimizer group,
// never stepped) and step count, its extent; the rank's shard as [shard_begin, shard_end) of the
// chunk. UsageError for a group at or beyond `num_groups`.
std::vector<PlannedRun> plan_runs(const std::vector<uint8_t>& has_grad, const std::vector<int>& group_of_slot,
                                  const std::vector<int64_t>& steps, const std::vector<SlotExtent>& slots,
                                  int64_t shard_begin, int64_t shard_end, size_t num_groups);

}  // namespace gx
