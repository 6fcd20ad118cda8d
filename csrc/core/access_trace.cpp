#include "access_trace.h"

#include <algorithm>

namespace gx {

void AccessTrace::record(ChunkId id) {
  const size_t pos = current_.size();
  if (pos >= kMaxLength) {
    diverged_ = true;
    return;
  }
  if (!recorded_.empty() && !diverged_ && (pos >= recorded_.size() || recorded_[pos] != id)) diverged_ = true;
  current_.push_back(id);
}

bool AccessTrace::end_iteration() {
  iterations_ += 1;
  const bool same = !recorded_.empty() && !diverged_ && current_.size() == recorded_.size();
  if (!same) {
    if (!recorded_.empty()) rerecordings_ += 1;
    recorded_ = current_;
    index_recorded();
  }
  current_.clear();
  diverged_ = false;
  return same;
}

void AccessTrace::index_recorded() {
  positions_.clear();
  for (size_t i = 0; i < recorded_.size(); ++i) positions_[recorded_[i]].push_back(i);
}

size_t AccessTrace::next_use(ChunkId id, size_t from) const {
  auto it = positions_.find(id);
  if (it == positions_.end()) return kNever;
  auto p = std::lower_bound(it->second.begin(), it->second.end(), from);
  return p == it->second.end() ? kNever : *p;
}

}  // namespace gx
