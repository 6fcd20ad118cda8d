// BeladyEviction: evict the chunk whose next use is farthest away (Belady's optimal rule),
// using the recorded access trace; LRU where the trace cannot tell.
//
// Design note. Given the evictable candidates (the manager's business: device copy present, no
// tensor in COMPUTE) and the current position in the iteration, the victim is the candidate
// whose next recorded access comes last; a chunk never used again in this iteration goes first.
// Candidates the trace cannot rank (no usable trace: warm-up or diverged iteration) fall back to
// the LRU order. Ties go to the least recently used, then to the lowest id: deterministic.
#pragma once

#include <optional>
#include <vector>

#include "access_trace.h"
#include "lru_eviction.h"

namespace gx {

std::optional<ChunkId> choose_farthest_next_use(const std::vector<ChunkId>& candidates, const AccessTrace& trace,
                                                const LruEviction& lru);

}  // namespace gx
