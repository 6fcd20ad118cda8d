// Chunk sets: a parameter chunk and the companions that share its layout.
//
// Design note. Every parameter chunk P (the compute dtype: bf16, fp16 or fp32) of trainable
// parameters comes with companions of the same layout: G (gradients, compute dtype), M (fp32
// master; absent when P itself is fp32) and one fp32 chunk per state kind of the optimizer rule
// (Adam: exp_avg and exp_avg_sq; SGD with momentum: momentum_buffer; Lion: exp_avg; Adagrad: sum;
// none for plain SGD and for optimizers stepped generically). The state chunks are laid out with
// the others but get memory only when an optimizer is attached (its rule says which kinds).
// Frozen parameters live in chunks of their own with no companions. The set is the unit that
// placement decides (where the optimizer state lives, P's home) and that the optimizer steps;
// its per-slot books (which slot has a gradient, how many steps each took) live here too. The
// gradients' squared norms taken on the device are torch tensors: the manager keeps them.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/types.h"

namespace gx {

// The values a parameter has besides its compute copy: its fp32 value (the master, or P itself
// for fp32 and frozen parameters) and the optimizer states a rule may declare.
enum class StateKind : uint8_t { kParam, kExpAvg, kExpAvgSq, kMomentumBuffer, kSum };
const char* state_kind_name(StateKind kind);
StateKind parse_state_kind(const std::string& name);  // UsageError naming the accepted names

struct ChunkSetSpec {
  ChunkId param = -1;
  ChunkId grad = -1;
  ChunkId master = -1;  // -1: P is the fp32 master itself (precision fp32)
  // The optimizer rule's state chunks, in the rule's order.
  std::vector<std::pair<StateKind, ChunkId>> states;
  bool optim_on_host = true;
  bool param_home_on_host = false;
  bool keep_gathered = false;  // sharded: P stays gathered after forward, until its gradients are reduced
  // The optimizer state is on the device because the host cannot hold it (the auto policy's
  // host-bound sets): the host has no room for G either, so eviction never moves G there.
  bool grad_stays_on_device = false;

  ChunkId state(StateKind kind) const;  // -1 when the set has no such state
  // The chunks the optimizer owns: the master (when there is one) and every state chunk.
  std::vector<ChunkId> optimizer_chunks() const;
};

struct ParamSpec {
  ChunkId chunk = -1;  // its P chunk
  size_t slot = 0;
  bool trainable = true;
};

enum class GradPlace { kNone, kDevice, kHost };

struct ChunkSet {
  ChunkSetSpec spec;
  bool trainable = false;
  std::vector<int> params;           // parameter index per slot of P
  std::vector<uint8_t> has_grad;     // per slot: a gradient is in G
  std::vector<int64_t> step;         // per slot: optimizer steps taken
  GradPlace grad_place = GradPlace::kNone;  // sharded: where the reduced shard is
  bool grad_collecting = false;              // sharded: this backward's gradients are in a gathered G buffer
  bool reduced = false;              // gradients of this backward reduced and sent to the optimizer's tier
};

// The sets in the order the recorded iteration first touches their P chunks (forward order);
// sets it never touched follow in index order. The manager recomputes it when an iteration ends;
// the optimizer steps host sets in this order and gives each launch its position as priority.
struct ForwardOrder {
  std::vector<int> sets;
  std::vector<int64_t> rank;  // per set index: its position in `sets`
};

}  // namespace gx
