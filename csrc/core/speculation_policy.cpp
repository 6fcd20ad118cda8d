#include "core/speculation_policy.h"

#include "core/errors.h"

namespace gx {

SpeculationDecision SpeculationPolicy::backward_started() {
  backwards_this_step_ += 1;
  const int64_t expected = backwards_expected();
  if (backwards_this_step_ < expected) {
    return {false, detail::concat("gradient accumulation: backward ", backwards_this_step_, " of the ", expected,
                                  " the last step had; the last one speculates")};
  }
  if (last_step_scaled_)
    return {false, "the last step's gradients were scaled (clipped): the steps wait for step() until a step is not"};
  return {true, steps_ == 0 ? "speculation: no step yet, guessing no clipping"
                            : "speculation: the last step was not clipped"};
}

void SpeculationPolicy::step_taken(double grad_multiplier) {
  backwards_per_step_ = backwards_this_step_;
  backwards_this_step_ = 0;
  last_step_scaled_ = grad_multiplier != 1.0;
  steps_ += 1;
  if (grad_multiplier < 1.0) steps_scaled_ += 1;
}

void SpeculationPolicy::grads_cleared() { backwards_this_step_ = 0; }

void SpeculationPolicy::restore(const Memory& m) {
  GX_CHECK(m.backwards_per_step >= 0, "speculation policy: backwards_per_step must be >= 0, got ",
           m.backwards_per_step, ".");
  backwards_per_step_ = m.backwards_per_step;
  last_step_scaled_ = m.last_step_scaled;
  backwards_this_step_ = 0;
}

}  // namespace gx
