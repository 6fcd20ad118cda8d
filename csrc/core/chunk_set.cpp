#include "core/chunk_set.h"

#include "core/errors.h"

namespace gx {

const char* state_kind_name(StateKind kind) {
  switch (kind) {
    case StateKind::kParam: return "param";
    case StateKind::kExpAvg: return "exp_avg";
    case StateKind::kExpAvgSq: return "exp_avg_sq";
    case StateKind::kMomentumBuffer: return "momentum_buffer";
    case StateKind::kSum: return "sum";
  }
  return "?";
}

StateKind parse_state_kind(const std::string& name) {
  for (StateKind k : {StateKind::kParam, StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kMomentumBuffer,
                      StateKind::kSum})
    if (name == state_kind_name(k)) return k;
  GX_CHECK(false, "state kind: expected 'param', 'exp_avg', 'exp_avg_sq', 'momentum_buffer' or 'sum', got '", name,
           "'.");
}

ChunkId ChunkSetSpec::state(StateKind kind) const {
  for (const auto& [k, id] : states)
    if (k == kind) return id;
  return -1;
}

std::vector<ChunkId> ChunkSetSpec::optimizer_chunks() const {
  std::vector<ChunkId> out;
  if (master >= 0) out.push_back(master);
  for (const auto& [kind, id] : states) out.push_back(id);
  return out;
}

}  // namespace gx
