#include "torch/host_buffer.h"

#include <ATen/ops/from_blob.h>

#include "core/errors.h"

namespace gx::torch_layer {

at::Tensor host_buffer(const std::shared_ptr<DeviceContext>& context, size_t bytes) {
  GX_CHECK(context != nullptr, "host_buffer: expected a DeviceContext, got None.");
  GX_CHECK(bytes > 0, "host_buffer: expected bytes > 0, got 0.");
  MemoryResource& resource = context->backend().host_memory();
  void* ptr = resource.allocate(bytes);
  // The deleter holds the context: the resource outlives every buffer it handed out.
  auto release = [context, bytes](void* p) { context->backend().host_memory().deallocate(p, bytes); };
  return at::from_blob(ptr, {static_cast<int64_t>(bytes)}, release,
                       at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

}  // namespace gx::torch_layer
