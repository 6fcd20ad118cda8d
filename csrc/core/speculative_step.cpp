#include "core/speculative_step.h"

#include "core/errors.h"

namespace gx {

const char* to_string(GuessState s) {
  switch (s) {
    case GuessState::kStepping: return "stepping";
    case GuessState::kStepped: return "stepped";
    case GuessState::kSkipped: return "skipped";
    case GuessState::kJudgedEarly: return "judged early";
    case GuessState::kJudged: return "judged";
    case GuessState::kUndone: return "undone";
  }
  return "?";
}

const char* to_string(GuessEvent e) {
  switch (e) {
    case GuessEvent::kTaskStepped: return "task stepped";
    case GuessEvent::kTaskSkipped: return "task skipped";
    case GuessEvent::kJudge: return "judge";
    case GuessEvent::kUndo: return "undo";
  }
  return "?";
}

GuessState next_guess_state(GuessState from, GuessEvent event) {
  using S = GuessState;
  using E = GuessEvent;
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
  GX_INTERNAL_ASSERT(false, "speculative step: event '", to_string(event), "' in state '", to_string(from), "'");
  return from;
}

GuessState SpeculativeStep::apply(GuessEvent event) {
  std::lock_guard<std::mutex> lock(mutex_);
  const GuessState before = state_;
  state_ = next_guess_state(state_, event);
  return before;
}

GuessState SpeculativeStep::state() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return state_;
}

}  // namespace gx
