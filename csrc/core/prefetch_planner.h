// Prefetch planning: which chunks to start fetching now, from the recorded trace.
//
// Design note. Walking the recorded order from the current position, the planner collects the
// next distinct chunks that are not on the device and not already in flight, at most
// `max_prefetch` of them, and only while their bytes fit in the device bytes actually free under
// the budget (never by count alone: a prefetch must not force an eviction of something needed
// sooner). It looks at most `lookahead` accesses ahead. No usable trace (warm-up, diverged
// iteration): no prefetch. The planner decides; the manager issues the copies.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "access_trace.h"

namespace gx {

struct PrefetchQuery {
  int max_prefetch = 2;
  int64_t free_bytes = 0;   // budget minus what the device tier holds now
  size_t lookahead = 64;    // accesses of the trace to scan
  std::function<bool(ChunkId)> needs_fetch;     // not on the device and not in flight
  std::function<int64_t(ChunkId)> chunk_bytes;  // bytes a fetch would take on the device
};

std::vector<ChunkId> plan_prefetch(const AccessTrace& trace, const PrefetchQuery& query);

}  // namespace gx
