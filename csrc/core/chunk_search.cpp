#include "chunk_search.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "chunk.h"
#include "errors.h"
#include "types.h"

namespace gx {

std::pair<int64_t, int64_t> simulate_packing(const std::vector<int64_t>& numels, int64_t chunk_size_numel,
                                             int64_t alignment_numel, int world_size) {
  int64_t wasted = 0;
  int64_t chunks = 0;
  int64_t used = 0;      // end of the last slot of the open chunk
  int64_t payload = 0;   // payload of the open chunk
  bool open = false;
  const int64_t padded_chunk = shard_numel_for(chunk_size_numel, alignment_numel, world_size) * world_size;
  auto close_open = [&] {
    if (open) wasted += padded_chunk - payload;
    open = false;
  };
  for (int64_t n : numels) {
    if (n > chunk_size_numel) {  // a chunk of its own; the open chunk stays open
      wasted += shard_numel_for(n, alignment_numel, world_size) * world_size - n;
      ++chunks;
      continue;
    }
    const int64_t offset =
        open ? static_cast<int64_t>(round_up(static_cast<size_t>(used), static_cast<size_t>(alignment_numel))) : 0;
    if (open && offset + n <= chunk_size_numel) {
      used = offset + n;
      payload += n;
    } else {
      close_open();
      open = true;
      ++chunks;
      used = n;
      payload = n;
    }
  }
  close_open();
  return {wasted, chunks};
}

ChunkSearchResult search_chunk_size(const ChunkSearchInput& in) {
  GX_CHECK(!in.tensor_numels.empty(), "search_chunk_size: no tensors to place; the model has no parameters.");
  GX_CHECK(in.search_range_numel >= 0, "search_range: expected >= 0 elements, got ", in.search_range_numel, ".");
  GX_CHECK(in.min_chunk_size_numel >= 0, "min_chunk_size: expected >= 0 elements, got ", in.min_chunk_size_numel, ".");
  GX_CHECK(in.search_interval_numel > 0, "search_interval: expected > 0 elements, got ", in.search_interval_numel,
           ".");
  GX_CHECK(in.alignment_numel > 0, "alignment_numel: expected > 0, got ", in.alignment_numel, ".");
  GX_CHECK(in.world_size > 0, "world_size: expected >= 1, got ", in.world_size, ".");
  for (int64_t n : in.tensor_numels) GX_CHECK(n > 0, "search_chunk_size: tensor numel expected > 0, got ", n, ".");

  ChunkSearchResult result;
  const auto count = static_cast<double>(in.tensor_numels.size());
  double mean = 0.0;
  for (int64_t n : in.tensor_numels) mean += static_cast<double>(n);
  mean /= count;
  double var = 0.0;
  for (int64_t n : in.tensor_numels) var += (static_cast<double>(n) - mean) * (static_cast<double>(n) - mean);
  const double outlier_above = mean + 3.0 * std::sqrt(var / count);

  std::vector<int64_t> regular;
  int64_t largest_regular = 0;
  for (size_t i = 0; i < in.tensor_numels.size(); ++i) {
    const int64_t n = in.tensor_numels[i];
    result.total_numel += n;
    if (in.filter_exlarge && static_cast<double>(n) > outlier_above) {
      result.exlarge_indices.push_back(static_cast<int64_t>(i));
    } else {
      largest_regular = std::max(largest_regular, n);
    }
  }
  const int64_t start = std::max({in.min_chunk_size_numel, largest_regular, int64_t{1}});
  const int64_t end = start + in.search_range_numel;
  result.wasted_numel = std::numeric_limits<int64_t>::max();
  // An outlier larger than a candidate gets a chunk of its own in the simulation, exactly as
  // the ChunkManager places a tensor larger than the chunk size.
  for (int64_t size = start; size <= end; size += in.search_interval_numel) {
    auto [wasted, chunks] = simulate_packing(in.tensor_numels, size, in.alignment_numel, in.world_size);
    ++result.candidates;
    if (wasted < result.wasted_numel) {
      result.wasted_numel = wasted;
      result.chunk_size_numel = size;
      result.num_chunks = chunks;
    }
  }
  return result;
}

}  // namespace gx
