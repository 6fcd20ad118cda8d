// LruEviction: which device-resident chunk to evict first, least recently used first.
//
// Design note. The policy only remembers, per chunk, the tick of its last access (a counter the
// caller advances on every access) and answers "which of these evictable chunks goes first?".
// It never moves anything and never decides what is evictable: the caller (the manager) passes
// the chunks that hold a device copy and have no tensor in COMPUTE. Ties (never-used chunks)
// go to the lowest chunk id, so the choice is deterministic. A farthest-next-use policy that
// knows the recorded access trace replaces it once the scheduler records traces.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "types.h"

namespace gx {

class LruEviction {
 public:
  void touch(ChunkId id);  // records an access now
  int64_t last_use(ChunkId id) const;  // -1 if never used
  // The least recently used of `candidates`, or nullopt if there are none.
  std::optional<ChunkId> choose(const std::vector<ChunkId>& candidates) const;

 private:
  std::vector<int64_t> last_use_;
  int64_t tick_ = 0;
};

}  // namespace gx
