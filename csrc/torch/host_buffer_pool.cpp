#include "torch/host_buffer_pool.h"

#include <ATen/ops/from_blob.h>

#include "core/errors.h"

#ifdef GX_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace gx::torch_layer {

HostBufferPool::HostBufferPool(std::shared_ptr<DeviceContext> context)
    : context_(std::move(context)), pool_(context_->backend().host_memory()) {
  const at::Device device = context_->device_for(Tier::kDevice);
  device_index_ = device.has_index() ? device.index() : 0;
}

at::Tensor HostBufferPool::buffer(size_t bytes, const std::vector<uintptr_t>& streams) {
  GX_CHECK(bytes > 0, "HostBufferPool.buffer: expected bytes > 0, got 0.");
  FixedSizePool::Ordered slot = pool_.allocate_ordered(bytes);  // OutOfMemoryError where the host cannot
  order_first_use(slot.wait_for, streams);
  auto self = shared_from_this();
  auto release = [self, bytes, streams](void* p) {
    std::vector<std::shared_ptr<Event>> last_uses;
    try {
      last_uses = self->record_last_uses(streams);
    } catch (...) {  // a deleter must not throw; a device that cannot record events has stopped anyway
    }
    self->pool_.deallocate_after(p, bytes, std::move(last_uses));
  };
  return at::from_blob(slot.ptr, {static_cast<int64_t>(bytes)}, release,
                       at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

void HostBufferPool::order_first_use(const std::vector<std::shared_ptr<Event>>& pending,
                                     const std::vector<uintptr_t>& streams) {
#ifdef GX_WITH_CUDA
  if (!streams.empty()) {
    auto stream = reinterpret_cast<cudaStream_t>(streams.front());
    for (const auto& event : pending) {
      auto* cuda_event = dynamic_cast<CudaEvent*>(event.get());
      GX_INTERNAL_ASSERT(cuda_event != nullptr, "a host buffer's last use is not a CUDA event");
      GX_CUDA_CHECK(cudaStreamWaitEvent(stream, cuda_event->raw(), 0));
    }
    return;
  }
#endif
  for (const auto& event : pending) event->synchronize();  // no stream to order on: copies were synchronous
}

std::vector<std::shared_ptr<Event>> HostBufferPool::record_last_uses(const std::vector<uintptr_t>& streams) const {
  std::vector<std::shared_ptr<Event>> events;
#ifdef GX_WITH_CUDA
  for (uintptr_t s : streams) {
    events.push_back(std::make_shared<CudaEvent>(device_index_, reinterpret_cast<cudaStream_t>(s)));
  }
#endif
  return events;
}

}  // namespace gx::torch_layer
