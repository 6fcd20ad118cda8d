// The speculative step's lifecycle (core/speculative_step.h) and the policy that decides when to
// speculate (core/speculation_policy.h).
#include <gtest/gtest.h>

#include "core/errors.h"
#include "core/speculation_policy.h"
#include "core/speculative_step.h"

namespace gx {
namespace {

using GS = GuessState;
using GE = GuessEvent;

TEST(SpeculativeStep, EveryLegalTransitionAndNothingElse) {
  const GS all[] = {GS::kStepping, GS::kStepped, GS::kSkipped, GS::kJudgedEarly, GS::kJudged, GS::kUndone};
  const GE events[] = {GE::kTaskStepped, GE::kTaskSkipped, GE::kJudge, GE::kUndo};
  struct Legal {
    GS from;
    GE event;
    GS to;
  };
  const Legal legal[] = {
      {GS::kStepping, GE::kTaskStepped, GS::kStepped}, {GS::kStepping, GE::kTaskSkipped, GS::kSkipped},
      {GS::kStepping, GE::kJudge, GS::kJudgedEarly},   {GS::kJudgedEarly, GE::kTaskStepped, GS::kJudged},
      {GS::kJudgedEarly, GE::kTaskSkipped, GS::kJudged}, {GS::kStepped, GE::kJudge, GS::kJudged},
      {GS::kSkipped, GE::kJudge, GS::kJudged},          {GS::kStepped, GE::kUndo, GS::kUndone},
      {GS::kSkipped, GE::kUndo, GS::kUndone},
  };
  for (GS from : all) {
    for (GE event : events) {
      const Legal* found = nullptr;
      for (const Legal& l : legal)
        if (l.from == from && l.event == event) found = &l;
      if (found != nullptr) {
        EXPECT_EQ(next_guess_state(from, event), found->to) << to_string(from) << " + " << to_string(event);
      } else {
        EXPECT_THROW(next_guess_state(from, event), InternalError) << to_string(from) << " + " << to_string(event);
      }
    }
  }
}

TEST(SpeculativeStep, ApplyReturnsTheStateBefore) {
  SpeculativeStep step;
  EXPECT_EQ(step.apply(GE::kJudge), GS::kStepping);  // judged while the task runs
  EXPECT_EQ(step.apply(GE::kTaskStepped), GS::kJudgedEarly);  // the task sees the verdict
  EXPECT_EQ(step.state(), GS::kJudged);
  EXPECT_THROW(step.apply(GE::kUndo), InternalError);
}

TEST(SpeculationPolicy, GuessesUntilAStepIsClippedAndAgainAfterOneIsNot) {
  SpeculationPolicy policy;
  EXPECT_TRUE(policy.backward_started().speculate);  // nothing to go by yet
  policy.step_taken(0.25);                           // clipped
  const SpeculationDecision after_clip = policy.backward_started();
  EXPECT_FALSE(after_clip.speculate);
  EXPECT_NE(after_clip.why.find("clipped"), std::string::npos) << after_clip.why;
  policy.step_taken(0.5);
  EXPECT_FALSE(policy.backward_started().speculate);
  policy.step_taken(1.0);  // within max_norm
  EXPECT_TRUE(policy.backward_started().speculate);
  policy.step_taken(1.0);
  EXPECT_EQ(policy.steps_taken(), 4);
  EXPECT_EQ(policy.steps_scaled(), 2);
}

TEST(SpeculationPolicy, SpeculatesOnTheBackwardExpectedToBeTheLast) {
  SpeculationPolicy policy;
  EXPECT_TRUE(policy.backward_started().speculate);  // one backward per step, until shown otherwise
  EXPECT_TRUE(policy.backward_started().speculate);  // a second: the guess failed (undone), guess again
  EXPECT_TRUE(policy.backward_started().speculate);
  EXPECT_TRUE(policy.backward_started().speculate);
  policy.step_taken(1.0);  // four backwards made that step
  EXPECT_EQ(policy.backwards_expected(), 4);
  for (int k = 1; k <= 3; ++k) {
    const SpeculationDecision d = policy.backward_started();
    EXPECT_FALSE(d.speculate) << k;
    EXPECT_NE(d.why.find("accumulation"), std::string::npos) << d.why;
  }
  EXPECT_TRUE(policy.backward_started().speculate);  // the fourth
  policy.step_taken(1.0);
  EXPECT_FALSE(policy.backward_started().speculate);
  policy.grads_cleared();  // zero_grad without a step: the count starts again
  EXPECT_FALSE(policy.backward_started().speculate);
  EXPECT_FALSE(policy.backward_started().speculate);
  EXPECT_FALSE(policy.backward_started().speculate);
  EXPECT_TRUE(policy.backward_started().speculate);
}

}  // namespace
}  // namespace gx
