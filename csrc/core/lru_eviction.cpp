#include "lru_eviction.h"

#include "errors.h"

namespace gx {

void LruEviction::touch(ChunkId id) {
  GX_CHECK(id >= 0, "LruEviction::touch: chunk id must be >= 0, got ", id, ".");
  if (static_cast<size_t>(id) >= last_use_.size()) last_use_.resize(static_cast<size_t>(id) + 1, -1);
  last_use_[static_cast<size_t>(id)] = tick_++;
}

int64_t LruEviction::last_use(ChunkId id) const {
  return id >= 0 && static_cast<size_t>(id) < last_use_.size() ? last_use_[static_cast<size_t>(id)] : -1;
}

std::optional<ChunkId> LruEviction::choose(const std::vector<ChunkId>& candidates) const {
  std::optional<ChunkId> best;
  for (ChunkId id : candidates) {
    if (!best || last_use(id) < last_use(*best) || (last_use(id) == last_use(*best) && id < *best)) best = id;
  }
  return best;
}

}  // namespace gx
