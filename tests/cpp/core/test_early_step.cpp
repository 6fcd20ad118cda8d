// When the host steps start (core/early_step.h): the decision ladder, the policy's memory, the
// shared lifecycle, the verdicts over every mode x interruption, and the run plan.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/early_step.h"
#include "core/errors.h"

namespace gx {
namespace {

using ES = EarlyStepState;
using EE = EarlyStepEvent;

EarlyStepFacts in_place_facts() {
  EarlyStepFacts f;
  f.configured = HostSteps::kInPlace;
  f.optimizer_name = "AdamW";
  f.rule_corrects_in_place = true;
  f.host_available_bytes = 400;  // room for half: 200, the least set (100) but not all (300)
  f.spare_bytes_least = 100;
  f.spare_bytes_all = 300;
  return f;
}

// One backward after a fresh policy: each row changes one fact and names the mode, the cover and
// a phrase of the reason. Read top to bottom, the rows are the ladder of EarlyStepPolicy::decide.
TEST(EarlyStepPolicy, TheLadderOneFactAtATime) {
  struct Row {
    const char* name;
    void (*change)(EarlyStepFacts&);
    EarlyMode mode;
    EarlyCover cover;
    const char* reason;
  };
  const Row rows[] = {
      {"in place, nothing against it", [](EarlyStepFacts&) {}, EarlyMode::kInPlace, EarlyCover::kEverySet,
       "no step yet"},
      {"a rule without native kernels", [](EarlyStepFacts& f) { f.rule_native = false; }, EarlyMode::kAtStep,
       EarlyCover::kNone, "AdamW has no native kernel"},
      {"in backward", [](EarlyStepFacts& f) { f.configured = HostSteps::kInBackward; }, EarlyMode::kInBackward,
       EarlyCover::kEverySet, "optimizer_step_in_backward=True"},
      {"in backward, a whole-set rule",
       [](EarlyStepFacts& f) {
         f.configured = HostSteps::kInBackward;
         f.rule_steps_whole_sets = true;
       },
       EarlyMode::kAtStep, EarlyCover::kNone, "steps whole sets"},
      {"serial", [](EarlyStepFacts& f) { f.configured = HostSteps::kSerial; }, EarlyMode::kAtStep, EarlyCover::kNone,
       "overlap_optimizer=False"},
      {"fp16 loss scaling", [](EarlyStepFacts& f) { f.loss_scaled = true; }, EarlyMode::kAtStep, EarlyCover::kNone,
       "fp16 loss scaling"},
      {"at step", [](EarlyStepFacts& f) { f.configured = HostSteps::kAtStep; }, EarlyMode::kAtStep,
       EarlyCover::kNone, "'off'"},
      {"the placement decides now", [](EarlyStepFacts& f) { f.placement_decides_now = true; }, EarlyMode::kAtStep,
       EarlyCover::kNone, "placement is decided"},
      {"in place, the rule cannot correct: spares",
       [](EarlyStepFacts& f) { f.rule_corrects_in_place = false; }, EarlyMode::kSpares, EarlyCover::kSomeSets,
       "some sets' spares"},
      {"spares, the host holds every set's", [](EarlyStepFacts& f) {
         f.configured = HostSteps::kSpares;
         f.host_available_bytes = 600;
       },
       EarlyMode::kSpares, EarlyCover::kEverySet, "every host set's spares"},
      {"spares, no room for any set", [](EarlyStepFacts& f) {
         f.configured = HostSteps::kSpares;
         f.host_available_bytes = 199;
       },
       EarlyMode::kAtStep, EarlyCover::kNone, "no host set's spares"},
      {"spares, the host's memory unreadable", [](EarlyStepFacts& f) {
         f.configured = HostSteps::kSpares;
         f.host_available_bytes.reset();
       },
       EarlyMode::kAtStep, EarlyCover::kNone, "no host set's spares"},
      {"spares, no host set", [](EarlyStepFacts& f) {
         f.configured = HostSteps::kSpares;
         f.spare_bytes_least.reset();
         f.spare_bytes_all = 0;
       },
       EarlyMode::kAtStep, EarlyCover::kNone, "no host set's spares"},
      {"spares, clipping with no norm yet", [](EarlyStepFacts& f) {
         f.configured = HostSteps::kSpares;
         f.max_norm = 1.0;
       },
       EarlyMode::kAtStep, EarlyCover::kNone, "clipping at max_norm=1.0: the last norm was above it"},
      {"spares, the last norm within max_norm", [](EarlyStepFacts& f) {
         f.configured = HostSteps::kSpares;
         f.max_norm = 0.5;
         f.last_norm = 0.5;
       },
       EarlyMode::kSpares, EarlyCover::kSomeSets, "some sets' spares"},
      {"spares, the last norm above max_norm", [](EarlyStepFacts& f) {
         f.configured = HostSteps::kSpares;
         f.max_norm = 0.5;
         f.last_norm = 0.6;
       },
       EarlyMode::kAtStep, EarlyCover::kNone, "max_norm=0.5"},
      {"spares, the user clipped the last step", [](EarlyStepFacts& f) {
         f.configured = HostSteps::kSpares;
         f.user_clipped_last = true;
       },
       EarlyMode::kAtStep, EarlyCover::kNone, "the last step's gradients were clipped"},
  };
  for (const Row& row : rows) {
    EarlyStepFacts facts = in_place_facts();
    row.change(facts);
    EarlyStepPolicy policy;
    const EarlyStepDecision d = policy.decide(facts);
    EXPECT_EQ(d.mode, row.mode) << row.name << ": " << to_string(d.mode);
    EXPECT_EQ(d.cover, row.cover) << row.name << ": " << to_string(d.cover);
    EXPECT_NE(d.reason.find(row.reason), std::string::npos) << row.name << ": " << d.reason;
    EXPECT_EQ(d.mode == EarlyMode::kAtStep, d.cover == EarlyCover::kNone) << row.name;
  }
}

TEST(EarlyStepPolicy, SparesTakeHalfTheHostThenOnlyWhatCoversEverySet) {
  EarlyStepPolicy policy;
  EarlyStepFacts f = in_place_facts();
  f.configured = HostSteps::kSpares;
  f.host_available_bytes = 500;  // none held: half of it
  EarlyStepDecision d = policy.decide(f);
  EXPECT_EQ(d.spare_allowance_bytes, 250);
  EXPECT_EQ(d.cover, EarlyCover::kSomeSets);
  // 250 held, 100 more to cover every set: within half of (available + held) less what is held
  f.spare_bytes_held = 250;
  f.spare_bytes_all = 100;
  f.spare_bytes_least = 50;
  f.host_available_bytes = 200;  // (200 + 250) / 2 - 250 < 0: no more
  d = policy.decide(f);
  EXPECT_EQ(d.mode, EarlyMode::kAtStep) << d.reason;
  f.host_available_bytes = 500;  // (500 + 250) / 2 - 250 = 125 >= 100
  d = policy.decide(f);
  EXPECT_EQ(d.mode, EarlyMode::kSpares);
  EXPECT_EQ(d.cover, EarlyCover::kEverySet);
  EXPECT_EQ(d.spare_allowance_bytes, 100);
}

TEST(EarlyStepPolicy, ThePlacementsIterationPlansForEverySetOnlyWithoutClipping) {
  EarlyStepPolicy policy;
  EarlyStepFacts f = in_place_facts();
  f.placement_decides_now = true;
  EXPECT_EQ(policy.decide(f).planned_cover, EarlyCover::kEverySet);
  f.max_norm = 1.0;
  EXPECT_FALSE(policy.decide(f).planned_cover.has_value());
}

TEST(EarlyStepPolicy, GuessesUntilAStepIsClippedAndAgainAfterOneIsNot) {
  EarlyStepPolicy policy;
  const EarlyStepFacts f = in_place_facts();
  EXPECT_EQ(policy.decide(f).mode, EarlyMode::kInPlace);  // nothing to go by yet
  policy.step_taken(0.25);                                 // clipped
  const EarlyStepDecision after_clip = policy.decide(f);
  EXPECT_EQ(after_clip.mode, EarlyMode::kAtStep);
  EXPECT_NE(after_clip.reason.find("clipped"), std::string::npos) << after_clip.reason;
  policy.step_taken(0.5);
  EXPECT_EQ(policy.decide(f).mode, EarlyMode::kAtStep);
  policy.step_taken(1.0);  // within max_norm
  EXPECT_EQ(policy.decide(f).mode, EarlyMode::kInPlace);
  policy.step_taken(1.0);
  EXPECT_EQ(policy.steps_taken(), 4);
  EXPECT_EQ(policy.steps_scaled(), 2);
}

TEST(EarlyStepPolicy, GuessesOnTheBackwardExpectedToBeTheLast) {
  EarlyStepPolicy policy;
  const EarlyStepFacts f = in_place_facts();
  for (int k = 0; k < 4; ++k)  // one backward per step until shown otherwise: each guesses (and is undone)
    EXPECT_EQ(policy.decide(f).mode, EarlyMode::kInPlace) << k;
  policy.step_taken(1.0);  // four backwards made that step
  EXPECT_EQ(policy.backwards_expected(), 4);
  for (int k = 1; k <= 3; ++k) {
    const EarlyStepDecision d = policy.decide(f);
    EXPECT_EQ(d.mode, EarlyMode::kAtStep) << k;
    EXPECT_NE(d.reason.find("accumulation"), std::string::npos) << d.reason;
  }
  EXPECT_EQ(policy.decide(f).mode, EarlyMode::kInPlace);  // the fourth
  policy.step_taken(1.0);
  EXPECT_EQ(policy.decide(f).mode, EarlyMode::kAtStep);
  policy.grads_cleared();  // zero_grad without a step: the count starts again
  for (int k = 0; k < 3; ++k) EXPECT_EQ(policy.decide(f).mode, EarlyMode::kAtStep) << k;
  EXPECT_EQ(policy.decide(f).mode, EarlyMode::kInPlace);
}

TEST(EarlyStepPolicy, ARunResumedFromItsMemoryDecidesAsTheRunThatWroteIt) {
  EarlyStepPolicy writer;
  const EarlyStepFacts f = in_place_facts();
  writer.decide(f);
  writer.decide(f);
  writer.step_taken(0.5);  // two backwards, clipped
  EarlyStepPolicy resumed;
  resumed.restore(writer.memory());
  for (int k = 0; k < 3; ++k) {
    const EarlyStepDecision a = writer.decide(f), b = resumed.decide(f);
    EXPECT_EQ(a.mode, b.mode) << k;
    EXPECT_EQ(a.reason, b.reason) << k;
  }
  EXPECT_THROW(resumed.restore({-1, false}), UsageError);
}

TEST(EarlyStepLifecycle, EveryLegalTransitionAndNothingElse) {
  const ES all[] = {ES::kStepping, ES::kStepped, ES::kSkipped, ES::kJudgedEarly, ES::kJudged, ES::kUndone};
  const EE events[] = {EE::kTaskStepped, EE::kTaskSkipped, EE::kJudge, EE::kUndo};
  struct Legal {
    ES from;
    EE event;
    ES to;
  };
  const Legal legal[] = {
      {ES::kStepping, EE::kTaskStepped, ES::kStepped}, {ES::kStepping, EE::kTaskSkipped, ES::kSkipped},
      {ES::kStepping, EE::kJudge, ES::kJudgedEarly},   {ES::kJudgedEarly, EE::kTaskStepped, ES::kJudged},
      {ES::kJudgedEarly, EE::kTaskSkipped, ES::kJudged}, {ES::kStepped, EE::kJudge, ES::kJudged},
      {ES::kSkipped, EE::kJudge, ES::kJudged},          {ES::kStepped, EE::kUndo, ES::kUndone},
      {ES::kSkipped, EE::kUndo, ES::kUndone},
  };
  for (ES from : all) {
    for (EE event : events) {
      const Legal* found = nullptr;
      for (const Legal& l : legal)
        if (l.from == from && l.event == event) found = &l;
      if (found != nullptr) {
        EXPECT_EQ(next_early_state(from, event), found->to) << to_string(from) << " + " << to_string(event);
      } else {
        EXPECT_THROW(next_early_state(from, event), InternalError) << to_string(from) << " + " << to_string(event);
      }
    }
  }
}

TEST(EarlyStepLifecycle, ApplyReturnsTheStateBefore) {
  EarlyStepLifecycle step;
  EXPECT_EQ(step.apply(EE::kJudge), ES::kStepping);          // judged while the task runs
  EXPECT_EQ(step.apply(EE::kTaskStepped), ES::kJudgedEarly);  // the task sees the verdict
  EXPECT_EQ(step.state(), ES::kJudged);
  EXPECT_THROW(step.apply(EE::kUndo), InternalError);
}

// Every mode x every interruption between backward and step(): respond() gives the table of
// early_step.h cell by cell, and each answer is one the lifecycle and verdict_for carry out: what is
// discarded before step() is undone (step() then steps the set afresh), what is discarded at step()
// gets the verdict kDrop, what stays reaches a verdict that keeps it, what the task skipped is
// judged from the skipped state, and what in backward refuses would be a bug at step().
TEST(EarlyStep, EveryModeByEveryInterruption) {
  using I = Interruption;
  using R = EarlyResponse;
  const I interruptions[] = {I::kAnotherBackward, I::kRead,        I::kCheckpoint,  I::kZeroGrad,
                             I::kPlacementChange, I::kHyperChange, I::kScaledStep, I::kNonFiniteGrad};
  const EarlyMode modes[] = {EarlyMode::kAtStep, EarlyMode::kSpares, EarlyMode::kInPlace, EarlyMode::kInBackward};
  // Rows in the order of `interruptions`, columns in the order of `modes`; single rank.
  const R table[8][4] = {
      {R::kNothingStarted, R::kDiscarded, R::kDiscarded, R::kRefused},        // another backward
      {R::kNothingStarted, R::kDiscarded, R::kServedBefore, R::kFinal},       // read
      {R::kNothingStarted, R::kDiscarded, R::kServedBefore, R::kFinal},       // checkpoint
      {R::kNothingStarted, R::kDiscarded, R::kDiscarded, R::kRefused},        // zero_grad
      {R::kNothingStarted, R::kDiscarded, R::kDiscarded, R::kFinal},          // placement change
      {R::kNothingStarted, R::kDiscarded, R::kJudgedAtStep, R::kRefused},     // other hyperparameters
      {R::kNothingStarted, R::kDiscarded, R::kJudgedAtStep, R::kRefused},     // scaled step
      {R::kNothingStarted, R::kJudgedAtStep, R::kSkippedByTask, R::kFinal},   // non-finite gradient
  };
  int cells = 0;
  for (size_t row = 0; row < 8; ++row) {
    const I what = interruptions[row];
    // What step() sees of this interruption: its hyperparameters and multiplier.
    const bool same_hyper = what != I::kHyperChange;
    const double multiplier = what == I::kScaledStep ? 0.5 : 1.0;
    const bool at_step = what == I::kHyperChange || what == I::kScaledStep;  // known only at step()
    for (size_t col = 0; col < 4; ++col) {
      const EarlyMode mode = modes[col];
      const std::string cell = std::string(to_string(mode)) + " x " + to_string(what);
      const R r = respond(mode, what, /*sharded=*/false);
      EXPECT_EQ(r, table[row][col]) << cell << ": " << to_string(r);
      cells += 1;
      EarlyStepLifecycle life;
      switch (r) {
        case R::kNothingStarted:
          EXPECT_THROW(verdict_for(mode, true, same_hyper, multiplier), InternalError) << cell;
          break;
        case R::kDiscarded:
          life.apply(EE::kTaskStepped);
          if (at_step) {
            EXPECT_EQ(verdict_for(mode, true, same_hyper, multiplier), EarlyVerdict::kDrop) << cell;
          } else {  // needed before step(): undone now, and step() never judges it
            life.apply(EE::kUndo);
            EXPECT_EQ(life.state(), ES::kUndone) << cell;
            EXPECT_THROW(life.apply(EE::kJudge), InternalError) << cell;
          }
          break;
        case R::kJudgedAtStep:
        case R::kServedBefore:
        case R::kFinal:
          life.apply(EE::kTaskStepped);
          EXPECT_NE(verdict_for(mode, true, same_hyper, multiplier), EarlyVerdict::kDrop) << cell;
          life.apply(EE::kJudge);
          EXPECT_EQ(life.state(), ES::kJudged) << cell;
          break;
        case R::kSkippedByTask:
          life.apply(EE::kTaskSkipped);
          life.apply(EE::kJudge);  // step() runs the serial step's work for the skipped set
          EXPECT_EQ(life.state(), ES::kJudged) << cell;
          break;
        case R::kRefused:
          if (at_step) {
            EXPECT_THROW(verdict_for(mode, true, same_hyper, multiplier), InternalError) << cell;
          }
          break;
      }
    }
  }
  EXPECT_EQ(cells, 32);
  // Sharded, a read is a collective over every rank's shard: the in-place step is undone first.
  EXPECT_EQ(respond(EarlyMode::kInPlace, I::kRead, true), R::kDiscarded);
  EXPECT_EQ(respond(EarlyMode::kInPlace, I::kCheckpoint, true), R::kDiscarded);
  EXPECT_EQ(respond(EarlyMode::kSpares, I::kRead, true), R::kDiscarded);
  EXPECT_EQ(respond(EarlyMode::kInBackward, I::kRead, true), R::kFinal);
  // An undone set reaches step() with other inputs than the task's, wherever it is judged.
  EXPECT_EQ(verdict_for(EarlyMode::kInPlace, false, true, 1.0), EarlyVerdict::kDrop);
  EXPECT_EQ(verdict_for(EarlyMode::kSpares, false, true, 1.0), EarlyVerdict::kDrop);
}

TEST(PlanRuns, RunsJoinSlotsOfOneGroupAndStepAndCutAtTheShard) {
  // five slots of 10 elements at 0, 10, 20, 30, 40 (padding: 30-35 belongs to slot 3's 5)
  const std::vector<SlotExtent> slots = {{0, 10}, {10, 10}, {20, 10}, {30, 5}, {40, 10}};
  const std::vector<uint8_t> grad = {1, 1, 1, 0, 1};
  const std::vector<int> group = {0, 0, 1, 0, 1};
  const std::vector<int64_t> steps = {3, 3, 3, 3, 3};
  const auto runs = plan_runs(grad, group, steps, slots, 0, 50, 2);
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs[0].first_slot, 0u);
  EXPECT_EQ(runs[0].last_slot, 1u);
  EXPECT_EQ(runs[0].step_after, 4);
  EXPECT_EQ(runs[0].shard_numel(), 20);
  EXPECT_EQ(runs[1].group, 1);
  EXPECT_EQ(runs[2].first_slot, 4u);  // slot 3 has no gradient: it splits the runs
  // another step count splits a run too
  const auto split = plan_runs({1, 1}, {0, 0}, {3, 4}, {{0, 10}, {10, 10}}, 0, 20, 1);
  ASSERT_EQ(split.size(), 2u);
  EXPECT_EQ(split[1].step_after, 5);
  // a shard of [15, 42): offsets into it; a run outside it keeps its place with no elements
  const auto sharded = plan_runs(grad, group, steps, slots, 15, 42, 2);
  ASSERT_EQ(sharded.size(), 3u);
  EXPECT_EQ(sharded[0].shard_begin, 0);
  EXPECT_EQ(sharded[0].shard_end, 5);
  EXPECT_EQ(sharded[1].shard_begin, 5);
  EXPECT_EQ(sharded[1].shard_end, 15);
  EXPECT_EQ(sharded[2].shard_numel(), 2);
  const auto outside = plan_runs({1}, {0}, {0}, {{0, 10}}, 20, 30, 1);
  ASSERT_EQ(outside.size(), 1u);
  EXPECT_EQ(outside[0].shard_numel(), 0);
  // frozen slots (group -1) are never stepped; a group beyond those passed is the caller's mistake
  EXPECT_TRUE(plan_runs({1}, {-1}, {0}, {{0, 10}}, 0, 10, 1).empty());
  EXPECT_THROW(plan_runs({1}, {2}, {0}, {{0, 10}}, 0, 10, 2), UsageError);
}

TEST(HostSteps, NamesReadBackAndOthersAreRefused) {
  for (HostSteps h : {HostSteps::kSerial, HostSteps::kAtStep, HostSteps::kSpares, HostSteps::kInPlace,
                      HostSteps::kInBackward})
    EXPECT_EQ(host_steps_from(to_string(h)), h);
  try {
    host_steps_from("sometimes");
    FAIL() << "no exception";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("'sometimes'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace gx
