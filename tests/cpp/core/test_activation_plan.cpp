// plan_activations: the per-block choice of keeping, recomputing or offloading activations.
#include <gtest/gtest.h>

#include <algorithm>

#include "core/activation_plan.h"

namespace gx {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// `n` alike blocks: 10 MiB of activations, a 1 MiB input, 10 ms forward, 20 ms backward.
ActivationPlanInputs alike(size_t n, int64_t device_free_bytes, double link_bytes_per_second) {
  ActivationPlanInputs in;
  in.blocks.assign(n, BlockCosts{10 * kMiB, 1 * kMiB, 0.010, 0.020});
  in.device_free_bytes = device_free_bytes;
  in.link_bytes_per_second = link_bytes_per_second;
  return in;
}

size_t count(const ActivationPlan& plan, BlockActivations choice) {
  return static_cast<size_t>(std::count(plan.choices.begin(), plan.choices.end(), choice));
}

TEST(ActivationPlan, EverythingKeptWhenItFits) {
  const ActivationPlan plan = plan_activations(alike(8, 80 * kMiB, 25e9));
  EXPECT_TRUE(plan.fits);
  EXPECT_EQ(count(plan, BlockActivations::kKeep), 8u);
  EXPECT_EQ(plan.device_bytes, 80 * kMiB);
  EXPECT_EQ(plan.added_seconds, 0.0);
}

TEST(ActivationPlan, HiddenCopiesOffloadOnlyWhatTheRoomCannotHold) {
  // A fast link hides both copies (1 MiB at 25 GB/s: 42 us against 10 and 20 ms): offloading a
  // block costs its recompute, as recomputing does, and frees 10 MiB instead of 9. Five blocks
  // must stop keeping their activations; their inputs fit the room, so none crosses the link.
  ActivationPlanInputs in = alike(8, 50 * kMiB, 25e9);
  const ActivationPlan plan = plan_activations(in);
  EXPECT_TRUE(plan.fits);
  EXPECT_EQ(count(plan, BlockActivations::kKeep), 3u);
  EXPECT_EQ(count(plan, BlockActivations::kRecompute), 5u);
  EXPECT_EQ(count(plan, BlockActivations::kOffload), 0u);
  // 3 kept (30 MiB) + 5 inputs + the working set (10)
  EXPECT_EQ(plan.device_bytes, 45 * kMiB);
  EXPECT_EQ(plan.host_bytes, 0);
  EXPECT_DOUBLE_EQ(plan.added_seconds, 5 * 0.010);
  EXPECT_EQ(plan.device_bytes, activation_device_bytes(in, plan.choices));
}

TEST(ActivationPlan, OffloadedInputsAreTheLastBlocksTheRoomCannotHold) {
  // Every block checkpointed (no kKeep); 8 inputs and the working set are 18 MiB, the room 15:
  // the inputs of the first blocks (fetched last in backward) go to the host.
  ActivationPlanInputs in = alike(8, 15 * kMiB, 25e9);
  in.allow_keep = false;
  const ActivationPlan plan = plan_activations(in);
  EXPECT_TRUE(plan.fits);
  // k offloaded: (8 - k) + 10 + min(k, 2) MiB <= 15 from k = 5
  EXPECT_EQ(count(plan, BlockActivations::kOffload), 5u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(plan.choices[i], BlockActivations::kOffload) << i;
  EXPECT_EQ(plan.host_bytes, 5 * kMiB);
  EXPECT_LE(plan.device_bytes, 15 * kMiB);
}

TEST(ActivationPlan, TheHostTakesNoMoreThanItsRoom) {
  // The same room, the host with room for three inputs: the plan cannot fit, and says so, with
  // no more than three inputs offloaded and the rest recomputed from the device.
  ActivationPlanInputs in = alike(8, 15 * kMiB, 25e9);
  in.allow_keep = false;
  in.host_free_bytes = 3 * kMiB + kMiB / 2;
  const ActivationPlan plan = plan_activations(in);
  EXPECT_FALSE(plan.fits);
  EXPECT_EQ(count(plan, BlockActivations::kOffload), 3u);
  EXPECT_EQ(count(plan, BlockActivations::kRecompute), 5u);
  EXPECT_EQ(plan.host_bytes, 3 * kMiB);
  // Inputs always offloaded (no plain recompute, no keep): the blocks beyond the host's room stay
  // checkpointed with their inputs on the device, as the runtime runs an input the host refuses.
  in.allow_recompute = false;
  const ActivationPlan refused = plan_activations(in);
  EXPECT_FALSE(refused.fits);
  EXPECT_EQ(count(refused, BlockActivations::kOffload), 3u);
  EXPECT_EQ(count(refused, BlockActivations::kRecompute), 5u);
  EXPECT_EQ(count(refused, BlockActivations::kKeep), 0u);
  // the device holds their five inputs, one block's recompute and the copies in flight, not five
  // blocks' activations
  EXPECT_LT(refused.device_bytes, 20 * kMiB);
}

TEST(ActivationPlan, ASlowLinkRecomputesFirstAndOffloadsOnlyWhatRecomputingCannotFree) {
  // 1 MiB at 10 MB/s: 105 ms each way, mostly exposed: recomputing is far cheaper per byte.
  const ActivationPlan ample = plan_activations(alike(8, 30 * kMiB, 10e6));
  EXPECT_TRUE(ample.fits);
  EXPECT_EQ(count(ample, BlockActivations::kOffload), 0u);
  // k recomputed: (8 - k) x 10 + k + 10 (the working set) MiB, within 30 from k = 7
  EXPECT_EQ(count(ample, BlockActivations::kRecompute), 7u);
  EXPECT_EQ(ample.device_bytes, 27 * kMiB);
  // Room below every block recomputed (18 MiB): inputs must leave the device as well.
  const ActivationPlan tight = plan_activations(alike(8, 15 * kMiB, 10e6));
  EXPECT_TRUE(tight.fits);
  EXPECT_GT(count(tight, BlockActivations::kOffload), 0u);
  EXPECT_EQ(count(tight, BlockActivations::kKeep), 0u);
  EXPECT_LE(tight.device_bytes, 15 * kMiB);
}

TEST(ActivationPlan, WithoutALinkNothingIsOffloaded) {
  const ActivationPlan plan = plan_activations(alike(4, 5 * kMiB, 0));
  EXPECT_FALSE(plan.fits);  // 4 inputs and the working set are 14 MiB
  EXPECT_EQ(count(plan, BlockActivations::kRecompute), 4u);
}

TEST(ActivationPlan, TooLittleRoomOffloadsEveryBlockAndSaysSo) {
  const ActivationPlan plan = plan_activations(alike(6, 1 * kMiB, 25e9));
  EXPECT_FALSE(plan.fits);
  EXPECT_EQ(count(plan, BlockActivations::kOffload), 6u);
  EXPECT_EQ(plan.device_bytes, 12 * kMiB);  // the working set and two inputs in flight
}

TEST(ActivationPlan, TheCheapestRecomputesGoFirst) {
  ActivationPlanInputs in = alike(4, 35 * kMiB, 0);
  in.blocks[2].forward_seconds = 0.0025;  // the same bytes, a quarter of the recompute
  // 40 MiB kept; one recompute leaves 41 (its working set), two leave 32
  const ActivationPlan plan = plan_activations(in);
  EXPECT_TRUE(plan.fits);
  EXPECT_EQ(plan.choices[0], BlockActivations::kRecompute);  // ties go to the earlier block
  EXPECT_EQ(plan.choices[1], BlockActivations::kKeep);
  EXPECT_EQ(plan.choices[2], BlockActivations::kRecompute);
  EXPECT_EQ(plan.choices[3], BlockActivations::kKeep);
  EXPECT_DOUBLE_EQ(plan.added_seconds, 0.0125);
}

TEST(ActivationPlan, TheChoicesAllowedNarrowTheMoves) {
  // Every block checkpointed (no kKeep): the plan starts from recomputing and offloads only what
  // the room needs; 8 inputs and the working set are 18 MiB.
  ActivationPlanInputs in = alike(8, 16 * kMiB, 25e9);
  in.allow_keep = false;
  const ActivationPlan checkpointed = plan_activations(in);
  EXPECT_TRUE(checkpointed.fits);
  EXPECT_EQ(count(checkpointed, BlockActivations::kKeep), 0u);
  EXPECT_GT(count(checkpointed, BlockActivations::kRecompute), 0u);
  EXPECT_GT(count(checkpointed, BlockActivations::kOffload), 0u);
  // Inputs always offloaded (no plain recompute): a block is kept or offloaded.
  in = alike(8, 50 * kMiB, 25e9);
  in.allow_recompute = false;
  const ActivationPlan offloaded = plan_activations(in);
  EXPECT_EQ(count(offloaded, BlockActivations::kRecompute), 0u);
  EXPECT_EQ(count(offloaded, BlockActivations::kOffload), 5u);
  // Neither recompute nor a link, and too little room: everything stays kept, and it does not fit.
  in = alike(2, kMiB, 0);
  in.allow_recompute = false;
  const ActivationPlan stuck = plan_activations(in);
  EXPECT_FALSE(stuck.fits);
  EXPECT_EQ(count(stuck, BlockActivations::kKeep), 2u);
  in.allow_keep = false;
  EXPECT_THROW(plan_activations(in), std::exception);
}

TEST(ActivationPlan, BadInputsAreRefused) {
  ActivationPlanInputs in = alike(2, 10 * kMiB, 1e9);
  in.in_flight = 0;
  EXPECT_THROW(plan_activations(in), std::exception);
  in = alike(2, -1, 1e9);
  EXPECT_THROW(plan_activations(in), std::exception);
  in = alike(2, 10 * kMiB, 1e9);
  EXPECT_THROW(activation_device_bytes(in, {BlockActivations::kKeep}), std::exception);
}

}  // namespace
}  // namespace gx
