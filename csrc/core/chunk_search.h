// Chunk-size search: the chunk size that wastes the fewest bytes for a given tensor layout.
//
// Design note. Tensors go into chunks in a fixed order (the recorded execution order when a
// trace exists, definition order otherwise), exactly as the ChunkManager will place them:
// aligned slot offsets, a new chunk whenever the next tensor does not fit, a chunk of its own
// for a tensor larger than the chunk size, every chunk padded to equal aligned shards. The waste
// of a candidate size is the sum over chunks of (padded size - payload). Candidates run from
// `start` to `start + search_range_numel` in steps of `search_interval_numel`, where `start` is
// the larger of `min_chunk_size_numel` and the largest tensor that is not an outlier. Outliers
// (with `filter_exlarge`: more than mean + 3 standard deviations, e.g. a huge embedding) always
// get a chunk of their own and do not drag every chunk up to their size. Ties go to the smaller
// size (finer-grained moves). Cost: O(candidates x tensors), a few milliseconds for a 7B layout
// at the default interval.
#pragma once

#include <cstdint>
#include <vector>

namespace gx {

struct ChunkSearchInput {
  std::vector<int64_t> tensor_numels;  // in placement order
  int64_t search_range_numel = 0;
  int64_t min_chunk_size_numel = 0;
  int64_t search_interval_numel = 32 * 1024;
  int64_t alignment_numel = 1;
  int world_size = 1;
  bool filter_exlarge = true;
};

struct ChunkSearchResult {
  int64_t chunk_size_numel = 0;
  int64_t wasted_numel = 0;
  int64_t num_chunks = 0;
  int64_t total_numel = 0;              // payload
  std::vector<int64_t> exlarge_indices;  // outliers left out when choosing `start`
  int64_t candidates = 0;
};

// Packs `numels` with chunk size `chunk_size_numel`; returns {wasted_numel, num_chunks}.
std::pair<int64_t, int64_t> simulate_packing(const std::vector<int64_t>& numels, int64_t chunk_size_numel,
                                             int64_t alignment_numel, int world_size);

ChunkSearchResult search_chunk_size(const ChunkSearchInput& input);

}  // namespace gx
