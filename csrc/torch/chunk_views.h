// Tensor views over chunk memory: the bridge from the ChunkManager's raw slots to ATen.
//
// Design note. A view is an at::Tensor made with from_blob over a chunk copy; it owns nothing.
// It is valid while that copy exists: a move that drops the tier's copy (or release() for a
// gathered view) leaves the view dangling, which is why only the engine, which orders moves
// against compute, hands such views to the model. Views of the device tier live on the
// backend's device (cuda:N for cuda, cpu for sim, whose "device" is host memory); views of
// host tiers live on the CPU. The DeviceContext also owns the backend and knows the compute
// stream, so the cuda backend follows torch's current stream.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>

#include "core/chunk_manager.h"
#include "core/device_backend.h"

namespace gx::torch_layer {

struct DeviceOptions {
  std::string kind = "sim";        // "sim" or "cuda"
  int device_index = 0;            // cuda device
  size_t capacity_bytes = 0;       // sim capacity, or cuda memory limit (0 = whole device)
  int64_t sim_max_copy_delay_us = 0;
  uint64_t sim_seed = 0;
};

// Owns one DeviceBackend and says where its tiers are in torch terms.
class DeviceContext {
 public:
  explicit DeviceContext(const DeviceOptions& options);
  DeviceBackend& backend() { return *backend_; }
  const std::string& kind() const { return options_.kind; }
  at::Device device_for(Tier tier) const;  // torch device of a tier's memory
  // Makes the backend's kCompute stream torch's current stream (cuda); no-op on sim.
  void sync_compute_stream();

 private:
  DeviceOptions options_;
  std::unique_ptr<DeviceBackend> backend_;
};

bool cuda_compiled();  // true in CUDA builds of the extension

// The whole shard copy of chunk `id` on `tier`, as a 1-D tensor of the chunk's dtype.
at::Tensor shard_view(DeviceContext& ctx, ChunkManager& mgr, ChunkId id, Tier tier);
// One tensor's slot on `tier`, in its registered shape.
at::Tensor tensor_view(DeviceContext& ctx, ChunkManager& mgr, const TensorHandle& handle, Tier tier);
// One tensor's slot in the gathered copy (after access()), in its registered shape.
at::Tensor gathered_view(DeviceContext& ctx, ChunkManager& mgr, const TensorHandle& handle);

// The part of slot `handle` that lies in this rank's shard, as [begin, end) offsets into the
// slot's elements and the matching offset into the shard (empty when begin == end).
struct SlotPart {
  int64_t begin = 0;        // first element of the slot inside the shard
  int64_t end = 0;          // one past the last
  int64_t shard_offset = 0;  // where `begin` lies in the shard
};
SlotPart slot_part_in_shard(const ChunkManager& mgr, const TensorHandle& handle);
// Writes the part of `value` (the whole tensor of the slot, any device and dtype) that lies in
// this rank's shard into the shard's copy on `tier`. Unsharded that is the whole slot.
void write_slot_part(DeviceContext& ctx, ChunkManager& mgr, const TensorHandle& handle, Tier tier,
                     const at::Tensor& value);

// The whole gathered chunk (all shards, padding included), as a 1-D tensor on the device.
at::Tensor gathered_chunk_view(DeviceContext& ctx, ChunkManager& mgr, ChunkId id);

}  // namespace gx::torch_layer
