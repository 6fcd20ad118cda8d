#include "belady_eviction.h"

namespace gx {

std::optional<ChunkId> choose_farthest_next_use(const std::vector<ChunkId>& candidates, const AccessTrace& trace,
                                                const LruEviction& lru) {
  if (!trace.usable()) return lru.choose(candidates);
  std::optional<ChunkId> best;
  size_t best_next = 0;
  for (ChunkId id : candidates) {
    const size_t next = trace.next_use(id, trace.position());
    const bool better = !best || next > best_next ||
                        (next == best_next && (lru.last_use(id) < lru.last_use(*best) ||
                                               (lru.last_use(id) == lru.last_use(*best) && id < *best)));
    if (better) {
      best = id;
      best_next = next;
    }
  }
  return best;
}

}  // namespace gx
