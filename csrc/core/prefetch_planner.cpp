#include "prefetch_planner.h"

#include <algorithm>

namespace gx {

std::vector<ChunkId> plan_prefetch(const AccessTrace& trace, const PrefetchQuery& q) {
  std::vector<ChunkId> out;
  if (!trace.usable() || q.max_prefetch <= 0) return out;
  const auto& order = trace.recorded();
  int64_t free_bytes = q.free_bytes;
  const size_t end = std::min(order.size(), trace.position() + q.lookahead);
  for (size_t i = trace.position(); i < end && static_cast<int>(out.size()) < q.max_prefetch; ++i) {
    const ChunkId id = order[i];
    if (std::find(out.begin(), out.end(), id) != out.end() || !q.needs_fetch(id)) continue;
    const int64_t bytes = q.chunk_bytes(id);
    if (bytes > free_bytes) break;  // in order: never skip ahead of a chunk that does not fit
    free_bytes -= bytes;
    out.push_back(id);
  }
  return out;
}

}  // namespace gx
