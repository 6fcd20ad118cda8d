// SpeculationPolicy: whether a backward pass should step the host-held chunk sets in place before
// optimizer.step() knows the gradients' multiplier (speculative_step.h).
//
// Design note. A guess that fails costs a corrective pass (clipping scaled the gradients) or an
// undo (another backward before step()), on top of the step itself: worth paying only when the
// guess usually holds. The policy guesses from what the steps so far showed:
//  * Clipping: a step whose multiplier was not 1 makes the next backward wait for step(); one
//    whose multiplier was 1 (the norm within max_norm, or no clipping) makes it guess again. With
//    every step clipping (random data, the first steps of a run) the steps then run where they
//    ran without speculation, and a run whose norm settles below max_norm speculates from its
//    first unclipped step on. Before any step there is nothing to go by: it guesses.
//  * Gradient accumulation: the number of backward passes between the last two steps is the
//    number expected now (one before any step), and only the backward expected to be the last
//    speculates. Backwards under no_sync count too. zero_grad() without a step starts the count
//    again (those gradients were dropped).
// Decision code only: the optimizer reports the events and acts on the answer.
#pragma once

#include <cstdint>
#include <string>

namespace gx {

struct SpeculationDecision {
  bool speculate = false;
  std::string why;
};

class SpeculationPolicy {
 public:
  // A backward pass begins: counted toward the next step, then the decision for it.
  SpeculationDecision backward_started();
  // optimizer.step() ran with this multiplier (1: the guess of "no scaling" held).
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
  int64_t backwards_this_step_ = 0;
  int64_t backwards_per_step_ = 0;  // as the last step saw it (0: no step yet)
  bool last_step_scaled_ = false;
  int64_t steps_ = 0;
  int64_t steps_scaled_ = 0;
};

}  // namespace gx
