// Chunk: a flat buffer of one dtype holding several tensors, the unit that moves between tiers.
//
// Design note.
//  * Layout. Tensors are appended in order. Each slot starts at an offset aligned to
//    `alignment_numel` elements (so SIMD and vectorised GPU kernels see aligned tensors).
//    A chunk has a capacity (`capacity_numel`, the chunk size of its group); a tensor larger
//    than the chunk size gets a chunk of its own whose capacity is that tensor's numel.
//  * Shards. `close()` freezes the layout and pads the chunk so that it splits into
//    `world_size` equal shards, each a multiple of `alignment_numel` elements. Rank r owns
//    elements [r * shard_numel, (r + 1) * shard_numel). The padding is part of the waste.
//  * Residency. A chunk records which tiers hold its shard (`shard_tiers`) and whether it is
//    gathered on the device. Pointers are set by the ChunkManager, which owns the memory; a
//    Chunk never allocates, moves or decides anything.
//  * States. Each slot has a TensorState; the chunk counts slots per state so that the three
//    predicates are O(1):
//      can_release(): no slot is COMPUTE and at least one is not FREE: every live tensor is
//                     HOLD or HOLD_AFTER_BWD, so the gathered copy may be dropped / re-sharded.
//      can_reduce():  every slot is READY_FOR_REDUCE: all gradients of the chunk are in.
//      can_move():    no slot is COMPUTE: nobody reads the payload, so it may change tier.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "tensor_state.h"
#include "types.h"

namespace gx {

struct TensorSlot {
  std::string name;
  int64_t offset_numel = 0;
  int64_t numel = 0;
  std::vector<int64_t> shape;
  TensorState state = TensorState::kFree;
};

struct ShardRange {
  int64_t begin_numel = 0;
  int64_t end_numel = 0;
  int64_t numel() const { return end_numel - begin_numel; }
};

class Chunk {
 public:
  Chunk(ChunkId id, std::string group, DType dtype, int64_t capacity_numel, int64_t alignment_numel,
        int world_size);

  // Appends a tensor; returns its slot index, or nullopt when it does not fit or the chunk is
  // closed. The slot starts FREE.
  std::optional<size_t> try_append(const std::string& name, int64_t numel, const std::vector<int64_t>& shape);

  // Freezes the layout and computes the padding to equal, aligned shards. Idempotent.
  void close();
  bool closed() const { return closed_; }

  ChunkId id() const { return id_; }
  const std::string& group() const { return group_; }
  DType dtype() const { return dtype_; }
  int world_size() const { return world_size_; }
  int64_t capacity_numel() const { return capacity_numel_; }
  int64_t alignment_numel() const { return alignment_numel_; }
  int64_t used_numel() const { return used_numel_; }      // end of the last slot
  int64_t payload_numel() const { return payload_numel_; }  // sum of slot numels
  // Valid after close():
  int64_t padded_numel() const;
  int64_t shard_numel() const;
  int64_t wasted_numel() const { return padded_numel() - payload_numel_; }
  size_t chunk_bytes() const { return static_cast<size_t>(padded_numel()) * element_size_bytes(dtype_); }
  size_t shard_bytes() const { return static_cast<size_t>(shard_numel()) * element_size_bytes(dtype_); }
  ShardRange shard_range(int rank) const;

  const std::vector<TensorSlot>& slots() const { return slots_; }
  const TensorSlot& slot(size_t index) const;
  size_t num_slots() const { return slots_.size(); }

  // State machine. Throws IllegalTransition for moves outside the table.
  void transition(size_t slot_index, TensorState to);
  int64_t count_in(TensorState state) const { return state_counts_[static_cast<int>(state)]; }
  bool can_release() const;
  bool can_reduce() const;
  bool can_move() const;

  // Residency, maintained by the ChunkManager.
  TierSet& shard_tiers() { return shard_tiers_; }
  const TierSet& shard_tiers() const { return shard_tiers_; }
  void* shard_ptr(Tier tier) const { return shard_ptrs_[static_cast<int>(tier)]; }
  void set_shard_ptr(Tier tier, void* ptr) { shard_ptrs_[static_cast<int>(tier)] = ptr; }
  bool gathered() const { return gathered_ptr_ != nullptr; }
  void* gathered_ptr() const { return gathered_ptr_; }
  void set_gathered_ptr(void* ptr) { gathered_ptr_ = ptr; }

 private:
  ChunkId id_;
  std::string group_;
  DType dtype_;
  int64_t capacity_numel_;
  int64_t alignment_numel_;
  int world_size_;
  bool closed_ = false;
  int64_t used_numel_ = 0;
  int64_t payload_numel_ = 0;
  int64_t shard_numel_ = 0;
  std::vector<TensorSlot> slots_;
  std::array<int64_t, kNumTensorStates> state_counts_{};
  TierSet shard_tiers_;
  std::array<void*, kNumTiers> shard_ptrs_{};
  void* gathered_ptr_ = nullptr;
};

// Shard numel of a chunk of `capacity_numel` elements split over `world_size` ranks, each
// shard a multiple of `alignment_numel`. Shared by Chunk::close and the chunk-size search.
int64_t shard_numel_for(int64_t capacity_numel, int64_t alignment_numel, int world_size);

}  // namespace gx
