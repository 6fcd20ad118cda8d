#include "torch/chunk_views.h"

#include <ATen/ops/from_blob.h>

#include <algorithm>

#include "core/errors.h"
#include "core/sim_backend.h"
#include "torch/dtype_map.h"

#ifdef GX_WITH_CUDA
#include <c10/cuda/CUDAStream.h>

#include "cuda/cuda_backend.h"
#endif

namespace gx::torch_layer {

bool cuda_compiled() {
#ifdef GX_WITH_CUDA
  return true;
#else
  return false;
#endif
}

DeviceContext::DeviceContext(const DeviceOptions& options) : options_(options) {
  if (options.kind == "sim") {
    GX_CHECK(options.capacity_bytes > 0, "sim_capacity: expected > 0 bytes, got 0.");
    backend_ = std::make_unique<SimBackend>(
        SimConfig{options.capacity_bytes, options.sim_max_copy_delay_us, options.sim_seed});
    return;
  }
  GX_CHECK(options.kind == "cuda", "device: expected 'sim' or 'cuda', got '", options.kind, "'.");
#ifdef GX_WITH_CUDA
  backend_ = std::make_unique<CudaBackend>(CudaConfig{options.device_index, options.capacity_bytes});
#else
  GX_CHECK(false, "device='cuda': this gemini_ext build has no CUDA support (built against a CPU torch or with "
                  "GEMINI_EXT_CUDA=0). Reinstall with a CUDA torch and nvcc, or use device='sim'.");
#endif
}

at::Device DeviceContext::device_for(Tier tier) const {
  if (tier == Tier::kDevice && options_.kind == "cuda")
    return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(options_.device_index));
  return at::Device(at::kCPU);
}

void DeviceContext::sync_compute_stream() {
#ifdef GX_WITH_CUDA
  if (auto* cuda = dynamic_cast<CudaBackend*>(backend_.get())) {
    cuda->set_compute_stream(
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(options_.device_index)).stream());
  }
#endif
}

namespace {
at::Tensor view_at(DeviceContext& ctx, const Chunk& c, void* base, Tier tier, int64_t offset_numel, int64_t numel,
                   const std::vector<int64_t>& shape) {
  auto options = at::TensorOptions().dtype(to_scalar_type(c.dtype())).device(ctx.device_for(tier));
  auto* start = static_cast<uint8_t*>(base) + static_cast<size_t>(offset_numel) * element_size_bytes(c.dtype());
  at::Tensor flat = at::from_blob(start, {numel}, options);
  return flat.view(shape);  // an empty shape gives a 0-d tensor (numel 1)
}
}  // namespace

at::Tensor shard_view(DeviceContext& ctx, ChunkManager& mgr, ChunkId id, Tier tier) {
  const Chunk& c = mgr.chunk(id);
  GX_CHECK(c.shard_tiers().contains(tier), "chunk ", id, " has no copy on ", to_string(tier), " (it is on ",
           c.shard_tiers().to_string(), ").");
  return view_at(ctx, c, c.shard_ptr(tier), tier, 0, c.shard_numel(), {c.shard_numel()});
}

at::Tensor tensor_view(DeviceContext& ctx, ChunkManager& mgr, const TensorHandle& handle, Tier tier) {
  const Chunk& c = mgr.chunk(handle.chunk_id);
  const TensorSlot& s = c.slot(handle.slot_index);
  void* ptr = mgr.tensor_ptr(handle, tier);  // validates tier and sharding
  return view_at(ctx, c, ptr, tier, 0, s.numel, s.shape);
}

at::Tensor gathered_view(DeviceContext& ctx, ChunkManager& mgr, const TensorHandle& handle) {
  const Chunk& c = mgr.chunk(handle.chunk_id);
  const TensorSlot& s = c.slot(handle.slot_index);
  return view_at(ctx, c, mgr.gathered_tensor_ptr(handle), Tier::kDevice, 0, s.numel, s.shape);
}

SlotPart slot_part_in_shard(const ChunkManager& mgr, const TensorHandle& handle) {
  const Chunk& c = mgr.chunk(handle.chunk_id);
  const TensorSlot& s = c.slot(handle.slot_index);
  const ShardRange shard = c.shard_range(mgr.rank());
  const int64_t lo = std::max(s.offset_numel, shard.begin_numel);
  const int64_t hi = std::min(s.offset_numel + s.numel, shard.end_numel);
  if (lo >= hi) return SlotPart{};
  return SlotPart{lo - s.offset_numel, hi - s.offset_numel, lo - shard.begin_numel};
}

void write_slot_part(DeviceContext& ctx, ChunkManager& mgr, const TensorHandle& handle, Tier tier,
                     const at::Tensor& value) {
  const Chunk& c = mgr.chunk(handle.chunk_id);
  const TensorSlot& s = c.slot(handle.slot_index);
  GX_CHECK(value.numel() == s.numel, "value for tensor '", s.name, "': expected ", s.numel, " elements, got ",
           value.numel(), ".");
  const SlotPart part = slot_part_in_shard(mgr, handle);
  if (part.begin == part.end) return;
  at::Tensor shard = shard_view(ctx, mgr, handle.chunk_id, tier);
  at::Tensor source = value.reshape({-1}).narrow(0, part.begin, part.end - part.begin);
  // A device value bound for a host copy of another dtype is converted on the device first: a
  // blocking copy_ would convert on the host instead, staging the whole value in a fresh
  // pageable buffer of the source dtype (an fp32 model's bf16 parameter chunks at enable()). The
  // copy to the host is then one DMA into page-locked chunk memory.
  if (source.is_cuda() && !shard.is_cuda() && source.scalar_type() != shard.scalar_type()) {
    source = source.to(shard.scalar_type());
  }
  shard.narrow(0, part.shard_offset, part.end - part.begin).copy_(source);
}

at::Tensor gathered_chunk_view(DeviceContext& ctx, ChunkManager& mgr, ChunkId id) {
  const Chunk& c = mgr.chunk(id);
  GX_CHECK(c.gathered(), "chunk ", id, " is not gathered on the device; access it (or allocate_gathered) first.");
  return view_at(ctx, c, c.gathered_ptr(), Tier::kDevice, 0, c.padded_numel(), {c.padded_numel()});
}

}  // namespace gx::torch_layer
