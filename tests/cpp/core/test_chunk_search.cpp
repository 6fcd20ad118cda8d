#include <gtest/gtest.h>

#include <chrono>
#include <iostream>

#include "core/chunk_search.h"
#include "core/errors.h"

namespace gx {
namespace {

TEST(SimulatePacking, CountsPaddingAndOversizedChunks) {
  // size 10: [6,4] full, [7] wastes 3, [12] own chunk exact.
  auto [wasted, chunks] = simulate_packing({6, 4, 7, 12}, 10, 1, 1);
  EXPECT_EQ(chunks, 3);
  EXPECT_EQ(wasted, 3);
  // world size 4, alignment 2: chunk 10 pads to shards of 4 -> 16; own chunk 12 -> 3 per rank -> 4 -> 16.
  auto [w2, c2] = simulate_packing({6, 4, 7, 12}, 10, 2, 4);
  EXPECT_EQ(c2, 3);
  EXPECT_EQ(w2, (16 - 10) + (16 - 7) + (16 - 12));
}

TEST(ChunkSearch, FindsTheZeroWasteSizeOfAPerfectLayout) {
  // 12 tensors of 3 elements: any multiple of 3 packs perfectly only if the chunk count divides...
  // chunk 9 -> 4 chunks of 9, zero waste; chunk 10 wastes 1 per chunk.
  ChunkSearchInput in;
  in.tensor_numels = std::vector<int64_t>(12, 3);
  in.min_chunk_size_numel = 8;
  in.search_range_numel = 4;
  in.search_interval_numel = 1;
  auto r = search_chunk_size(in);
  EXPECT_EQ(r.chunk_size_numel, 9);
  EXPECT_EQ(r.wasted_numel, 0);
  EXPECT_EQ(r.num_chunks, 4);
  EXPECT_EQ(r.total_numel, 36);
  EXPECT_EQ(r.candidates, 5);
}

TEST(ChunkSearch, OrderMatters) {
  ChunkSearchInput in;
  in.min_chunk_size_numel = 10;
  in.search_range_numel = 0;
  in.search_interval_numel = 1;
  in.filter_exlarge = false;
  in.tensor_numels = {6, 6, 4, 4};  // [6] [6,4] [4] -> waste 4 + 0 + 6
  EXPECT_EQ(search_chunk_size(in).wasted_numel, 10);
  in.tensor_numels = {6, 4, 6, 4};  // [6,4] [6,4] -> no waste
  EXPECT_EQ(search_chunk_size(in).wasted_numel, 0);
}

TEST(ChunkSearch, OutliersDoNotSetTheStartAndGetTheirOwnChunk) {
  ChunkSearchInput in;
  in.tensor_numels = std::vector<int64_t>(40, 100);
  in.tensor_numels.push_back(1000000);  // an embedding-like outlier
  in.min_chunk_size_numel = 0;
  in.search_range_numel = 1000;
  in.search_interval_numel = 100;
  auto r = search_chunk_size(in);
  ASSERT_EQ(r.exlarge_indices.size(), 1u);
  EXPECT_EQ(r.exlarge_indices[0], 40);
  EXPECT_LT(r.chunk_size_numel, 1000000);
  EXPECT_EQ(r.wasted_numel, 0);  // sizes that divide 40 x 100 exist in range
  EXPECT_EQ(r.chunk_size_numel % 100, 0);
  in.filter_exlarge = false;
  EXPECT_GE(search_chunk_size(in).chunk_size_numel, 1000000);
}

TEST(ChunkSearch, BadInputIsAUsageError) {
  ChunkSearchInput in;
  EXPECT_THROW(search_chunk_size(in), UsageError);
  in.tensor_numels = {4};
  in.search_interval_numel = 0;
  EXPECT_THROW(search_chunk_size(in), UsageError);
}

// The layout of a 7B GPT (d=4096, 32 layers, vocab 32000), searched over the default range of
// 128 Mi elements: prints how long it takes (no timed assertion; see the README for the figure).
TEST(ChunkSearch, SevenBillionParameterLayoutTiming) {
  const int64_t d = 4096, layers = 32, vocab = 32000;
  ChunkSearchInput in;
  in.tensor_numels.push_back(vocab * d);  // token embedding
  in.tensor_numels.push_back(2048 * d);   // position embedding
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t n : {d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d})
      in.tensor_numels.push_back(n);
  }
  in.tensor_numels.push_back(d);
  in.tensor_numels.push_back(d);
  in.search_range_numel = int64_t{128} << 20;
  in.min_chunk_size_numel = int64_t{32} << 20;
  in.alignment_numel = 32;
  int64_t total = 0;
  for (int64_t n : in.tensor_numels) total += n;
  EXPECT_GT(total, int64_t{6'500'000'000});
  const auto t0 = std::chrono::steady_clock::now();
  auto r = search_chunk_size(in);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::cout << "[chunk search] 7B layout: " << in.tensor_numels.size() << " tensors, " << r.candidates
            << " candidates, chunk " << r.chunk_size_numel << " elements, waste " << r.wasted_numel
            << " elements (" << 100.0 * r.wasted_numel / total << "%), " << ms << " ms\n";
  EXPECT_GE(r.chunk_size_numel, in.min_chunk_size_numel);
  EXPECT_LT(r.wasted_numel, total / 10);
}

}  // namespace
}  // namespace gx
