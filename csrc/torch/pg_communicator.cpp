#include "torch/pg_communicator.h"

#include <ATen/ops/from_blob.h>

#include <optional>

#include "core/errors.h"
#include "torch/dtype_map.h"

#ifdef GX_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/cuda_backend.h"
#endif

// The flat collectives are _allgather_base / _reduce_scatter_base in every torch we build
// against; torch 2.13 renamed them (all_gather_single, reduce_scatter_single) and keeps the old
// names as deprecated aliases, so the old names are used and the notice silenced.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace gx::torch_layer {
namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  return op == ReduceOp::kSum ? c10d::ReduceOp(c10d::ReduceOp::SUM) : c10d::ReduceOp(c10d::ReduceOp::MAX);
}

// Makes the backend's `stream` torch's current stream for the scope (cuda side streams only;
// kCompute is torch's current stream already, sim has no streams).
class StreamScope {
 public:
  StreamScope(DeviceContext& ctx, StreamKind stream) {
    ctx.sync_compute_stream();
#ifdef GX_WITH_CUDA
    if (stream == StreamKind::kCompute) return;
    if (auto* cuda = dynamic_cast<CudaBackend*>(&ctx.backend())) {
      const auto index = ctx.device_for(Tier::kDevice).index();
      guard_.emplace(c10::cuda::getStreamFromExternal(cuda->stream(stream), index));
    }
#endif
    // Sim: streams are worker threads and gloo blocks the caller, so the call starts after the
    // stream's queued work by waiting for it here.
    if (stream != StreamKind::kCompute && ctx.kind() == "sim") ctx.backend().synchronize(stream);
  }

 private:
#ifdef GX_WITH_CUDA
  std::optional<c10::cuda::CUDAStreamGuard> guard_;
#endif
};

}  // namespace

ProcessGroupCommunicator::ProcessGroupCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                   std::shared_ptr<DeviceContext> ctx)
    : group_(std::move(group)), ctx_(std::move(ctx)) {
  GX_CHECK(group_, "process_group: expected a torch.distributed ProcessGroup, got None.");
  world_size_ = group_->getSize();
  rank_ = group_->getRank();
  name_ = group_->getBackendName();
}

at::Tensor ProcessGroupCommunicator::device_view(const void* ptr, int64_t numel, DType dtype) const {
  auto options = at::TensorOptions().dtype(to_scalar_type(dtype)).device(ctx_->device_for(Tier::kDevice));
  return at::from_blob(const_cast<void*>(ptr), {numel}, options);
}

void ProcessGroupCommunicator::all_gather(const void* shard, void* full, int64_t shard_numel, DType dtype,
                                          StreamKind stream) {
  StreamScope scope(*ctx_, stream);
  at::Tensor in = device_view(shard, shard_numel, dtype);
  at::Tensor out = device_view(full, shard_numel * world_size_, dtype);
  group_->_allgather_base(out, in)->wait();
  calls_ += 1;
}

void ProcessGroupCommunicator::reduce_scatter(const void* full, void* shard, int64_t shard_numel, DType dtype,
                                              ReduceOp op, StreamKind stream) {
  StreamScope scope(*ctx_, stream);
  at::Tensor in = device_view(full, shard_numel * world_size_, dtype);
  at::Tensor out = device_view(shard, shard_numel, dtype);
  c10d::ReduceScatterOptions options;
  options.reduceOp = to_c10d(op);
  calls_ += 1;
  if (flat_reduce_scatter_) {
    try {
      group_->_reduce_scatter_base(out, in, options)->wait();
      return;
    } catch (const c10::Error&) {
      flat_reduce_scatter_ = false;  // e.g. an older gloo: all-reduce a copy instead
    }
  }
  std::vector<at::Tensor> whole{in.clone()};
  c10d::AllreduceOptions all;
  all.reduceOp = to_c10d(op);
  group_->allreduce(whole, all)->wait();
  out.copy_(whole[0].narrow(0, rank_ * shard_numel, shard_numel));
}

void ProcessGroupCommunicator::all_reduce(void* data, int64_t numel, DType dtype, ReduceOp op, StreamKind stream) {
  StreamScope scope(*ctx_, stream);
  std::vector<at::Tensor> tensors{device_view(data, numel, dtype)};
  c10d::AllreduceOptions options;
  options.reduceOp = to_c10d(op);
  group_->allreduce(tensors, options)->wait();
  calls_ += 1;
}

}  // namespace gx::torch_layer
