#include "chunk.h"

#include "errors.h"

namespace gx {

int64_t shard_numel_for(int64_t capacity_numel, int64_t alignment_numel, int world_size) {
  const int64_t per_rank = (capacity_numel + world_size - 1) / world_size;
  return static_cast<int64_t>(round_up(static_cast<size_t>(per_rank), static_cast<size_t>(alignment_numel)));
}

Chunk::Chunk(ChunkId id, std::string group, DType dtype, int64_t capacity_numel, int64_t alignment_numel,
             int world_size)
    : id_(id),
      group_(std::move(group)),
      dtype_(dtype),
      capacity_numel_(capacity_numel),
      alignment_numel_(alignment_numel),
      world_size_(world_size) {
  GX_CHECK(capacity_numel > 0, "chunk capacity_numel: expected > 0, got ", capacity_numel,
           ". Use a positive chunk size.");
  GX_CHECK(alignment_numel > 0, "chunk alignment_numel: expected > 0, got ", alignment_numel, ".");
  GX_CHECK(world_size > 0, "world_size: expected >= 1, got ", world_size, ".");
}

std::optional<size_t> Chunk::try_append(const std::string& name, int64_t numel, const std::vector<int64_t>& shape) {
  GX_CHECK(numel > 0, "tensor '", name, "': numel expected > 0, got ", numel,
           ". Empty tensors are not placed in chunks.");
  if (closed_) return std::nullopt;
  const int64_t offset = static_cast<int64_t>(round_up(static_cast<size_t>(used_numel_),
                                                       static_cast<size_t>(alignment_numel_)));
  if (offset + numel > capacity_numel_) return std::nullopt;
  slots_.push_back(TensorSlot{name, offset, numel, shape, TensorState::kFree});
  state_counts_[static_cast<int>(TensorState::kFree)] += 1;
  used_numel_ = offset + numel;
  payload_numel_ += numel;
  return slots_.size() - 1;
}

void Chunk::close() {
  if (closed_) return;
  closed_ = true;
  shard_numel_ = shard_numel_for(capacity_numel_, alignment_numel_, world_size_);
}

int64_t Chunk::padded_numel() const {
  GX_INTERNAL_ASSERT(closed_, "padded_numel of chunk ", id_, " asked before close()");
  return shard_numel_ * world_size_;
}

int64_t Chunk::shard_numel() const {
  GX_INTERNAL_ASSERT(closed_, "shard_numel of chunk ", id_, " asked before close()");
  return shard_numel_;
}

ShardRange Chunk::shard_range(int rank) const {
  GX_CHECK(rank >= 0 && rank < world_size_, "rank: expected in [0, ", world_size_, "), got ", rank, ".");
  return ShardRange{rank * shard_numel(), (rank + 1) * shard_numel()};
}

const TensorSlot& Chunk::slot(size_t index) const {
  GX_INTERNAL_ASSERT(index < slots_.size(), "slot ", index, " of chunk ", id_, " out of range (", slots_.size(),
                     " slots)");
  return slots_[index];
}

void Chunk::transition(size_t slot_index, TensorState to) {
  GX_INTERNAL_ASSERT(slot_index < slots_.size(), "slot ", slot_index, " of chunk ", id_, " out of range");
  TensorSlot& s = slots_[slot_index];
  check_transition(id_, s.name, s.state, to);
  state_counts_[static_cast<int>(s.state)] -= 1;
  state_counts_[static_cast<int>(to)] += 1;
  s.state = to;
}

bool Chunk::can_release() const {
  const int64_t live = static_cast<int64_t>(slots_.size()) - count_in(TensorState::kFree);
  return live > 0 && count_in(TensorState::kCompute) == 0 &&
         count_in(TensorState::kHold) + count_in(TensorState::kHoldAfterBwd) == live;
}

bool Chunk::can_reduce() const {
  return !slots_.empty() && count_in(TensorState::kReadyForReduce) == static_cast<int64_t>(slots_.size());
}

bool Chunk::can_move() const { return count_in(TensorState::kCompute) == 0; }

}  // namespace gx
