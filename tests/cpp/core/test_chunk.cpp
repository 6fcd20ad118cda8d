#include <gtest/gtest.h>

#include "core/chunk.h"
#include "core/errors.h"

namespace gx {
namespace {

using S = TensorState;

TEST(Chunk, SlotsAreAppendedInOrderAtAlignedOffsets) {
  Chunk c(0, "param", DType::kBFloat16, 100, 8, 1);
  EXPECT_EQ(*c.try_append("a", 5, {5}), 0u);
  EXPECT_EQ(*c.try_append("b", 10, {2, 5}), 1u);
  EXPECT_EQ(c.slot(0).offset_numel, 0);
  EXPECT_EQ(c.slot(1).offset_numel, 8);  // 5 rounded up to the alignment of 8
  EXPECT_EQ(c.slot(1).shape, (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(c.used_numel(), 18);
  EXPECT_EQ(c.payload_numel(), 15);
  EXPECT_EQ(c.slot(0).state, S::kFree);
}

TEST(Chunk, RefusesWhatDoesNotFitAndAfterClose) {
  Chunk c(0, "param", DType::kFloat32, 20, 4, 1);
  EXPECT_TRUE(c.try_append("a", 15, {15}).has_value());
  EXPECT_FALSE(c.try_append("b", 5, {5}).has_value());  // aligned offset 16 + 5 > 20
  EXPECT_TRUE(c.try_append("c", 4, {4}).has_value());   // 16 + 4 == 20 fits
  c.close();
  EXPECT_FALSE(c.try_append("d", 1, {1}).has_value());
}

TEST(Chunk, RejectsEmptyTensors) {
  Chunk c(0, "param", DType::kFloat32, 20, 1, 1);
  EXPECT_THROW(c.try_append("empty", 0, {0}), UsageError);
}

TEST(Chunk, PadsToEqualAlignedShardsPerRank) {
  Chunk c(3, "param", DType::kFloat16, 1000, 16, 4);
  ASSERT_TRUE(c.try_append("w", 999, {999}).has_value());
  c.close();
  // ceil(1000 / 4) = 250, rounded to 16 -> 256 per shard.
  EXPECT_EQ(c.shard_numel(), 256);
  EXPECT_EQ(c.padded_numel(), 1024);
  EXPECT_EQ(c.wasted_numel(), 1024 - 999);
  EXPECT_EQ(c.chunk_bytes(), 2048u);
  EXPECT_EQ(c.shard_bytes(), 512u);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(c.shard_range(r).begin_numel, r * 256);
    EXPECT_EQ(c.shard_range(r).end_numel, (r + 1) * 256);
  }
  EXPECT_THROW(c.shard_range(4), UsageError);
}

TEST(Chunk, ShardsConcatenateToTheWholeChunk) {
  for (int ws : {1, 2, 3, 4, 8}) {
    Chunk c(0, "param", DType::kFloat32, 777, 4, ws);
    ASSERT_TRUE(c.try_append("w", 700, {700}).has_value());
    c.close();
    int64_t next = 0;
    for (int r = 0; r < ws; ++r) {
      EXPECT_EQ(c.shard_range(r).begin_numel, next);
      next = c.shard_range(r).end_numel;
    }
    EXPECT_EQ(next, c.padded_numel());
    EXPECT_GE(c.padded_numel(), 777);
  }
}

TEST(Chunk, Predicates) {
  Chunk c(0, "param", DType::kFloat32, 64, 1, 1);
  c.try_append("a", 8, {8});
  c.try_append("b", 8, {8});
  EXPECT_FALSE(c.can_release());  // nothing live yet
  EXPECT_TRUE(c.can_move());
  EXPECT_FALSE(c.can_reduce());
  c.transition(0, S::kHold);
  c.transition(1, S::kHold);
  EXPECT_TRUE(c.can_release());
  c.transition(0, S::kCompute);
  EXPECT_FALSE(c.can_release());
  EXPECT_FALSE(c.can_move());
  c.transition(0, S::kHoldAfterBwd);
  EXPECT_TRUE(c.can_release());
  EXPECT_TRUE(c.can_move());
  c.transition(0, S::kReadyForReduce);
  EXPECT_FALSE(c.can_reduce());
  EXPECT_FALSE(c.can_release());
  c.transition(1, S::kReadyForReduce);
  EXPECT_TRUE(c.can_reduce());
  EXPECT_EQ(c.count_in(S::kReadyForReduce), 2);
}

}  // namespace
}  // namespace gx
