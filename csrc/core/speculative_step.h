// SpeculativeStep: the lifecycle of one chunk set's optimizer step taken during backward, in
// place, before optimizer.step() knows the gradients' multiplier (clipping) and hyperparameters.
//
// Design note. The step is a task on the optimizer thread; optimizer.step() gives it a verdict
// (confirm, correct, or undo and step again: the work of each is the rule's, see
// torch/optim/hybrid_optimizer_in_place.cpp), and whoever settles the set first makes its
// parameter copies coherent. The states, and why each transition exists:
//   kStepping  -> kStepped   the task stepped every run in place
//   kStepping  -> kSkipped   the task found a non-finite gradient and wrote nothing (a
//                            non-finite value could not be taken back out of the moments)
//   kStepping  -> kJudgedEarly  step() judged it while the task still ran: the task runs the
//                            verdict's work itself when it ends
//   kJudgedEarly -> kJudged  the task ended and ran the verdict's work
//   kStepped   -> kJudged    step() judged it after it ended: step() launches the verdict's work
//   kSkipped   -> kJudged    likewise (the verdict's work for a set left as it was)
//   kStepped   -> kUndone    the set was needed before step() judged it (another backward adds
//                            to its gradients, a read, zero_grad, a placement change): undone
//   kSkipped   -> kUndone    likewise, with nothing to undo
// kJudged and kUndone are final. Anything else is a bug (InternalError). The state is shared
// between the optimizer thread and the caller's: a SpeculativeStep's own mutex guards it.
#pragma once

#include <cstdint>
#include <mutex>

namespace gx {

enum class GuessState : int8_t { kStepping, kStepped, kSkipped, kJudgedEarly, kJudged, kUndone };
enum class GuessEvent : int8_t { kTaskStepped, kTaskSkipped, kJudge, kUndo };

const char* to_string(GuessState s);
const char* to_string(GuessEvent e);

// The state `event` leads to from `from`; InternalError for an illegal pair.
GuessState next_guess_state(GuessState from, GuessEvent event);

class SpeculativeStep {
 public:
  // Applies `event` under the mutex and returns the state before it.
  GuessState apply(GuessEvent event);
  GuessState state() const;

 private:
  mutable std::mutex mutex_;
  GuessState state_ = GuessState::kStepping;
};

}  // namespace gx
