// AccessTrace: the chunk access order of one training iteration, recorded and compared.
//
// Design note. The manager records every chunk it is asked to access (forward, backward,
// optimizer) in order; `end_iteration()` closes an iteration. The first completed iteration is
// the warm-up; from then on the recorded order is what the eviction (farthest next use) and the
// prefetcher (the next chunks) rely on. Control flow, sequence length or eval vs train can change
// the order, so the current iteration is compared access by access with the recorded one: at the
// first mismatch it is marked diverged, policies fall back to LRU and no prefetch for the rest of
// the iteration, and at its end the new order replaces the old one ("re-recorded"), never assumed
// identical. Queries are O(log n): per chunk, the sorted positions of its accesses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "types.h"

namespace gx {

class AccessTrace {
 public:
  static constexpr size_t kNever = static_cast<size_t>(-1);
  // An iteration longer than this (e.g. evaluation that never steps) stops being recorded and
  // counts as diverged.
  static constexpr size_t kMaxLength = size_t{1} << 20;

  void record(ChunkId id);
  // Closes the iteration. Returns true when it matched the recorded one exactly (same length,
  // same order); otherwise the new order becomes the recorded one.
  bool end_iteration();

  // A recorded iteration exists and the current one still follows it.
  bool usable() const { return !recorded_.empty() && !diverged_; }
  bool diverged() const { return diverged_; }
  size_t position() const { return current_.size(); }  // accesses so far in this iteration
  const std::vector<ChunkId>& recorded() const { return recorded_; }
  int64_t iterations() const { return iterations_; }
  int64_t rerecordings() const { return rerecordings_; }

  // Position of the first access of `id` at or after `from` in the recorded order; kNever if none.
  size_t next_use(ChunkId id, size_t from) const;

 private:
  void index_recorded();
  std::vector<ChunkId> recorded_;
  std::vector<ChunkId> current_;
  std::map<ChunkId, std::vector<size_t>> positions_;  // of the recorded order
  bool diverged_ = false;
  int64_t iterations_ = 0;
  int64_t rerecordings_ = 0;
};

}  // namespace gx
