#include "static_placement.h"

#include <cmath>

#include "errors.h"

namespace gx {

std::vector<bool> select_by_bytes(const std::vector<int64_t>& chunk_bytes, double fraction, bool from_back) {
  GX_CHECK(fraction >= 0.0 && fraction <= 1.0, "placement fraction: expected in [0, 1], got ", fraction, ".");
  int64_t total = 0;
  for (int64_t b : chunk_bytes) {
    GX_CHECK(b >= 0, "chunk bytes: expected >= 0, got ", b, ".");
    total += b;
  }
  // Exact in integer bytes: a chunk is taken while the selection stays within the budget.
  const auto budget = static_cast<int64_t>(std::floor(fraction * static_cast<double>(total)));
  std::vector<bool> selected(chunk_bytes.size(), false);
  int64_t taken = 0;
  const size_t n = chunk_bytes.size();
  for (size_t k = 0; k < n; ++k) {
    const size_t i = from_back ? n - 1 - k : k;
    if (taken + chunk_bytes[i] > budget) break;
    taken += chunk_bytes[i];
    selected[i] = true;
  }
  return selected;
}

std::vector<ChunkPlacement> static_placement(const std::vector<int64_t>& chunk_bytes, const StaticFractions& f) {
  const std::vector<bool> param = select_by_bytes(chunk_bytes, f.offload_param_frac, /*from_back=*/false);
  const std::vector<bool> optim = select_by_bytes(chunk_bytes, f.offload_optim_frac, /*from_back=*/true);
  std::vector<ChunkPlacement> out(chunk_bytes.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = ChunkPlacement{param[i], optim[i]};
  return out;
}

}  // namespace gx
