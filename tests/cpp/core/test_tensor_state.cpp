#include <gtest/gtest.h>

#include <set>
#include <string>
#include <utility>

#include "core/chunk.h"
#include "core/tensor_state.h"

namespace gx {
namespace {

using S = TensorState;
const S kAll[] = {S::kFree, S::kCompute, S::kHold, S::kHoldAfterBwd, S::kReadyForReduce};

// The table of states and transitions, written out independently of the implementation's matrix.
const std::set<std::pair<S, S>> kExpectedLegal = {
    {S::kFree, S::kHold},
    {S::kHold, S::kFree},
    {S::kHold, S::kCompute},
    {S::kHold, S::kReadyForReduce},
    {S::kCompute, S::kHold},
    {S::kCompute, S::kHoldAfterBwd},
    {S::kCompute, S::kReadyForReduce},
    {S::kHoldAfterBwd, S::kCompute},
    {S::kHoldAfterBwd, S::kReadyForReduce},
    {S::kHoldAfterBwd, S::kHold},
    {S::kReadyForReduce, S::kHold},
};

// Drives a one-tensor chunk from FREE into `target` along legal moves.
void drive_to(Chunk& c, S target) {
  c.transition(0, S::kHold);
  switch (target) {
    case S::kFree: c.transition(0, S::kFree); break;
    case S::kHold: break;
    case S::kCompute: c.transition(0, S::kCompute); break;
    case S::kHoldAfterBwd: c.transition(0, S::kCompute); c.transition(0, S::kHoldAfterBwd); break;
    case S::kReadyForReduce: c.transition(0, S::kReadyForReduce); break;
  }
  ASSERT_EQ(c.slot(0).state, target);
}

TEST(TensorState, TableMatchesSpec) {
  for (S from : kAll)
    for (S to : kAll)
      EXPECT_EQ(is_legal_transition(from, to), kExpectedLegal.count({from, to}) == 1)
          << to_string(from) << " -> " << to_string(to);
}

TEST(TensorState, EveryIllegalTransitionThrowsWithChunkTensorAndStates) {
  int illegal = 0;
  for (S from : kAll) {
    for (S to : kAll) {
      Chunk c(7, "param", DType::kFloat32, 16, 1, 1);
      ASSERT_TRUE(c.try_append("layer.weight", 4, {2, 2}).has_value());
      drive_to(c, from);
      if (kExpectedLegal.count({from, to})) {
        EXPECT_NO_THROW(c.transition(0, to));
        EXPECT_EQ(c.slot(0).state, to);
        continue;
      }
      ++illegal;
      try {
        c.transition(0, to);
        ADD_FAILURE() << "no throw for " << to_string(from) << " -> " << to_string(to);
      } catch (const IllegalTransition& e) {
        const std::string msg = e.what();
        EXPECT_EQ(e.chunk_id, 7);
        EXPECT_EQ(e.tensor_name, "layer.weight");
        EXPECT_EQ(e.from, from);
        EXPECT_EQ(e.to, to);
        EXPECT_NE(msg.find("chunk 7"), std::string::npos) << msg;
        EXPECT_NE(msg.find("layer.weight"), std::string::npos) << msg;
        EXPECT_NE(msg.find(std::string(to_string(from)) + " -> " + to_string(to)), std::string::npos) << msg;
        EXPECT_NE(msg.find("bug"), std::string::npos) << msg;
      }
      EXPECT_EQ(c.slot(0).state, from) << "a refused transition changed the state";
    }
  }
  EXPECT_EQ(illegal, 25 - static_cast<int>(kExpectedLegal.size()));
}

TEST(TensorState, IllegalTransitionIsAnInternalError) {
  EXPECT_THROW(check_transition(1, "w", S::kFree, S::kCompute), InternalError);
}

}  // namespace
}  // namespace gx
