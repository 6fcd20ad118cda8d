#include "core/early_step.h"

#include <cstdio>

#include "core/errors.h"

namespace gx {

const char* to_string(HostSteps h) {
  switch (h) {
    case HostSteps::kSerial: return "serial";
    case HostSteps::kAtStep: return "at_step";
    case HostSteps::kSpares: return "spares";
    case HostSteps::kInPlace: return "in_place";
    case HostSteps::kInBackward: return "in_backward";
  }
  return "?";
}

const char* to_string(EarlyMode m) {
  switch (m) {
    case EarlyMode::kAtStep: return "at_step";
    case EarlyMode::kSpares: return "spares";
    case EarlyMode::kInPlace: return "in_place";
    case EarlyMode::kInBackward: return "in_backward";
  }
  return "?";
}

const char* to_string(EarlyCover c) {
  switch (c) {
    case EarlyCover::kNone: return "none";
    case EarlyCover::kSomeSets: return "some sets";
    case EarlyCover::kEverySet: return "every set";
  }
  return "?";
}

HostSteps host_steps_from(const std::string& name) {
  for (HostSteps h : {HostSteps::kSerial, HostSteps::kAtStep, HostSteps::kSpares, HostSteps::kInPlace,
                      HostSteps::kInBackward})
    if (name == to_string(h)) return h;
  throw UsageError(detail::concat("host_steps: expected one of 'serial', 'at_step', 'spares', 'in_place', "
                                  "'in_backward', got '", name, "'."));
}

namespace {
// max_norm as Python writes a float ("1.0", "0.5"), so that a reason reads as the config was given.
std::string python_float(double x) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", x);
  std::string s = buf;
  for (int digits = 1; digits <= 17; ++digits) {  // the shortest form that reads back the same
    std::snprintf(buf, sizeof(buf), "%.*g", digits, x);
    double back = 0.0;
    if (std::sscanf(buf, "%lf", &back) == 1 && back == x) {
      s = buf;
      break;
    }
  }
  if (s.find_first_of(".eni") == std::string::npos) s += ".0";
  return s;
}
}  // namespace

EarlyStepDecision EarlyStepPolicy::decide(const EarlyStepFacts& facts) {
  backwards_this_step_ += 1;  // every backward counts, whatever it decides
  EarlyStepDecision d;
  if (!facts.rule_native) {
    d.reason = facts.optimizer_name + " has no native kernel: its own step() runs in step()";
    return d;
  }
  if (facts.configured == HostSteps::kInBackward) {
    if (facts.rule_steps_whole_sets) {
      d.reason = facts.optimizer_name + " steps whole sets: nothing to start early";
      return d;
    }
    d.mode = EarlyMode::kInBackward;
    d.cover = EarlyCover::kEverySet;
    d.reason = "optimizer_step_in_backward=True: each host set steps in place once its gradients land";
    return d;
  }
  if (facts.configured == HostSteps::kSerial) {
    d.reason = "overlap_optimizer=False: every set steps inside step()";
    return d;
  }
  if (facts.loss_scaled) {
    d.reason = "fp16 loss scaling: the gradients' multiplier is known at step() only";
    return d;
  }
  if (facts.configured == HostSteps::kAtStep) {
    d.reason = "host_step_speculation='off': every host set steps at step()";
    return d;
  }
  if (facts.configured == HostSteps::kInPlace && !facts.rule_steps_whole_sets && facts.rule_corrects_in_place)
    return decide_in_place(facts);
  return decide_spares(facts);
}

EarlyStepDecision EarlyStepPolicy::decide_in_place(const EarlyStepFacts& facts) const {
  EarlyStepDecision d;
  // Guesses started during the iteration whose end decides the placement would be undone by the
  // chunks moving before step(): that backward steps at step(); the later ones guess where nothing
  // says they will clip, which the placement plans for.
  if (facts.placement_decides_now) {
    if (facts.max_norm == 0.0) d.planned_cover = EarlyCover::kEverySet;
    d.reason = "the placement is decided at this iteration's end: the steps wait for step()";
    return d;
  }
  const int64_t expected = backwards_expected();
  if (backwards_this_step_ < expected) {
    d.reason = detail::concat("gradient accumulation: backward ", backwards_this_step_, " of the ", expected,
                              " the last step had; the last one speculates");
    return d;
  }
  if (last_step_scaled_) {
    d.reason = "the last step's gradients were scaled (clipped): the steps wait for step() until a step is not";
    return d;
  }
  d.mode = EarlyMode::kInPlace;
  d.cover = EarlyCover::kEverySet;
  d.reason = steps_ == 0 ? "speculation: no step yet, guessing no clipping"
                         : "speculation: the last step was not clipped";
  return d;
}

EarlyStepDecision EarlyStepPolicy::decide_spares(const EarlyStepFacts& facts) {
  EarlyStepDecision d;
  if (facts.user_clipped_last) {
    d.reason = "the last step's gradients were clipped: the multiplier is known at step() only";
    return d;
  }
  if (facts.max_norm > 0.0 && !(facts.last_norm.has_value() && *facts.last_norm <= facts.max_norm)) {
    d.reason = "clipping at max_norm=" + python_float(facts.max_norm) +
               ": the last norm was above it, or there was none yet";
    return d;
  }
  // Spares for as many host sets as half of the host's available memory holds (unreadable: none).
  // Once some are held, more are taken only to cover every host set (after a placement left fewer
  // sets on the host, say), within half of what they come from, so that host memory does not creep
  // up step after step as the host's free memory varies.
  const int64_t available = facts.host_available_bytes.value_or(0);
  const int64_t held = facts.spare_bytes_held;
  int64_t allowance_bytes = 0;
  if (held == 0) {
    allowance_bytes = available / 2;
  } else {
    const int64_t within = (available + held) / 2 - held;
    allowance_bytes = facts.spare_bytes_all <= (within > 0 ? within : 0) ? facts.spare_bytes_all : 0;
  }
  const bool some_set_fits =
      !facts.rule_steps_whole_sets && facts.spare_bytes_least.has_value() &&
      *facts.spare_bytes_least <= allowance_bytes;
  if (!some_set_fits) {
    d.reason = "speculation: the host holds no host set's spares (or holds no optimizer state)";
    return d;
  }
  d.mode = EarlyMode::kSpares;
  d.spare_allowance_bytes = allowance_bytes;
  if (facts.spare_bytes_all <= allowance_bytes) {
    d.cover = EarlyCover::kEverySet;
    d.reason = "speculation: the host holds every host set's spares";
  } else {
    d.cover = EarlyCover::kSomeSets;
    d.reason = "speculation: the host holds some sets' spares; those whose gradients come first start during "
               "backward, the others at step()";
  }
  return d;
}

void EarlyStepPolicy::step_taken(double grad_multiplier) {
  backwards_per_step_ = backwards_this_step_;
  backwards_this_step_ = 0;
  last_step_scaled_ = grad_multiplier != 1.0;
  steps_ += 1;
  if (grad_multiplier < 1.0) steps_scaled_ += 1;
}

void EarlyStepPolicy::grads_cleared() { backwards_this_step_ = 0; }

void EarlyStepPolicy::restore(const Memory& m) {
  GX_CHECK(m.backwards_per_step >= 0, "early step policy: backwards_per_step must be >= 0, got ",
           m.backwards_per_step, ".");
  backwards_per_step_ = m.backwards_per_step;
  last_step_scaled_ = m.last_step_scaled;
  backwards_this_step_ = 0;
}

const char* to_string(EarlyStepState s) {
  switch (s) {
    case EarlyStepState::kStepping: return "stepping";
    case EarlyStepState::kStepped: return "stepped";
    case EarlyStepState::kSkipped: return "skipped";
    case EarlyStepState::kJudgedEarly: return "judged early";
    case EarlyStepState::kJudged: return "judged";
    case EarlyStepState::kUndone: return "undone";
  }
  return "?";
}

const char* to_string(EarlyStepEvent e) {
  switch (e) {
    case EarlyStepEvent::kTaskStepped: return "task stepped";
    case EarlyStepEvent::kTaskSkipped: return "task skipped";
    case EarlyStepEvent::kJudge: return "judge";
    case EarlyStepEvent::kUndo: return "undo";
  }
  return "?";
}

EarlyStepState next_early_state(EarlyStepState from, EarlyStepEvent event) {
  using S = EarlyStepState;
  using E = EarlyStepEvent;
  switch (from) {
    case S::kStepping:
      if (event == E::kTaskStepped) return S::kStepped;
      if (event == E::kTaskSkipped) return S::kSkipped;
      if (event == E::kJudge) return S::kJudgedEarly;
      break;
    case S::kJudgedEarly:
      if (event == E::kTaskStepped || event == E::kTaskSkipped) return S::kJudged;
      break;
    case S::kStepped:
    case S::kSkipped:
      if (event == E::kJudge) return S::kJudged;
      if (event == E::kUndo) return S::kUndone;
      break;
    case S::kJudged:
    case S::kUndone: break;
  }
  GX_INTERNAL_ASSERT(false, "early step: event '", to_string(event), "' in state '", to_string(from), "'");
  return from;
}

EarlyStepState EarlyStepLifecycle::apply(EarlyStepEvent event) {
  std::lock_guard<std::mutex> lock(mutex_);
  const EarlyStepState before = state_;
  state_ = next_early_state(state_, event);
  return before;
}

EarlyStepState EarlyStepLifecycle::state() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return state_;
}

const char* to_string(EarlyVerdict v) {
  switch (v) {
    case EarlyVerdict::kConfirm: return "confirm";
    case EarlyVerdict::kCorrect: return "correct";
    case EarlyVerdict::kRedo: return "redo";
    case EarlyVerdict::kDrop: return "drop";
  }
  return "?";
}

EarlyVerdict verdict_for(EarlyMode mode, bool same_inputs, bool same_hyper, double grad_multiplier) {
  switch (mode) {
    case EarlyMode::kInBackward:
      GX_INTERNAL_ASSERT(same_inputs && same_hyper && grad_multiplier == 1.0,
                         "optimizer step in backward: a set stepped during backward with a gradient multiplier of 1 "
                         "and the backward's hyperparameters was judged with other inputs (same gradients: ",
                         same_inputs, ", same hyperparameters: ", same_hyper, ", multiplier ", grad_multiplier, ")");
      return EarlyVerdict::kConfirm;
    case EarlyMode::kSpares:  // exact or nothing: anything but the guess drops the spares
      return same_inputs && same_hyper && grad_multiplier == 1.0 ? EarlyVerdict::kConfirm : EarlyVerdict::kDrop;
    case EarlyMode::kInPlace:
      if (!same_inputs) return EarlyVerdict::kDrop;
      if (!same_hyper) return EarlyVerdict::kRedo;
      return grad_multiplier == 1.0 ? EarlyVerdict::kConfirm : EarlyVerdict::kCorrect;
    case EarlyMode::kAtStep: break;
  }
  GX_INTERNAL_ASSERT(false, "early step: a verdict asked for a set that did not step early");
  return EarlyVerdict::kDrop;
}

const char* to_string(Interruption i) {
  switch (i) {
    case Interruption::kAnotherBackward: return "another backward";
    case Interruption::kRead: return "read";
    case Interruption::kCheckpoint: return "checkpoint";
    case Interruption::kZeroGrad: return "zero_grad";
    case Interruption::kPlacementChange: return "placement change";
    case Interruption::kHyperChange: return "other hyperparameters";
    case Interruption::kScaledStep: return "scaled step";
    case Interruption::kNonFiniteGrad: return "non-finite gradient";
  }
  return "?";
}

const char* to_string(EarlyResponse r) {
  switch (r) {
    case EarlyResponse::kNothingStarted: return "nothing started";
    case EarlyResponse::kJudgedAtStep: return "judged at step";
    case EarlyResponse::kServedBefore: return "served before";
    case EarlyResponse::kDiscarded: return "discarded";
    case EarlyResponse::kSkippedByTask: return "skipped by the task";
    case EarlyResponse::kFinal: return "final";
    case EarlyResponse::kRefused: return "refused";
  }
  return "?";
}

EarlyResponse respond(EarlyMode mode, Interruption what, bool sharded) {
  using I = Interruption;
  using R = EarlyResponse;
  switch (mode) {
    case EarlyMode::kAtStep: return R::kNothingStarted;
    case EarlyMode::kSpares:
      // The originals stay untouched until step() confirms: anything but the guess holding drops the
      // spares. A non-finite gradient is no exception: the serial step computes the same values.
      return what == I::kNonFiniteGrad ? R::kJudgedAtStep : R::kDiscarded;
    case EarlyMode::kInPlace:
      switch (what) {
        case I::kRead:
        case I::kCheckpoint:  // sharded, a read is a collective over every rank's shard: undone first
          return sharded ? R::kDiscarded : R::kServedBefore;
        case I::kHyperChange:
        case I::kScaledStep: return R::kJudgedAtStep;
        case I::kNonFiniteGrad: return R::kSkippedByTask;  // a non-finite value cannot be undone
        case I::kAnotherBackward:
        case I::kZeroGrad:
        case I::kPlacementChange: return R::kDiscarded;
      }
      break;
    case EarlyMode::kInBackward:
      switch (what) {
        case I::kRead:
        case I::kCheckpoint:
        case I::kPlacementChange:
        case I::kNonFiniteGrad: return R::kFinal;
        case I::kAnotherBackward:
        case I::kZeroGrad:
        case I::kHyperChange:
        case I::kScaledStep: return R::kRefused;
      }
      break;
  }
  GX_INTERNAL_ASSERT(false, "early step: no response for mode ", static_cast<int>(mode), " and interruption ",
                     static_cast<int>(what));
  return R::kDiscarded;
}

std::vector<PlannedRun> plan_runs(const std::vector<uint8_t>& has_grad, const std::vector<int>& group_of_slot,
                                  const std::vector<int64_t>& steps, const std::vector<SlotExtent>& slots,
                                  int64_t shard_begin, int64_t shard_end, size_t num_groups) {
  GX_INTERNAL_ASSERT(has_grad.size() == slots.size() && group_of_slot.size() == slots.size() &&
                         steps.size() == slots.size(),
                     "plan_runs: ", slots.size(), " slots with ", has_grad.size(), " gradient flags, ",
                     group_of_slot.size(), " groups and ", steps.size(), " step counts");
  std::vector<PlannedRun> runs;
  for (size_t k = 0; k < slots.size(); ++k) {
    const int group = group_of_slot[k];
    if (!has_grad[k] || group < 0) continue;
    GX_CHECK(static_cast<size_t>(group) < num_groups, "parameter group ", group, " of slot ", k, ": only ",
             num_groups, " groups were passed.");
    if (!runs.empty() && runs.back().last_slot + 1 == k && runs.back().group == group &&
        runs.back().step_after == steps[k] + 1) {
      runs.back().last_slot = k;
    } else {
      runs.push_back(PlannedRun{k, k, group, steps[k] + 1, 0, 0});
    }
  }
  for (PlannedRun& r : runs) {  // the run's elements within this rank's shard, as offsets into it
    const int64_t first = slots[r.first_slot].offset;
    const int64_t last = slots[r.last_slot].offset + slots[r.last_slot].numel;
    r.shard_begin = (first > shard_begin ? first : shard_begin) - shard_begin;
    r.shard_end = (last < shard_end ? last : shard_end) - shard_begin;
  }
  return runs;
}

}  // namespace gx
