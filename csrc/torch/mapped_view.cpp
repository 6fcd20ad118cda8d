#include "torch/mapped_view.h"

#include <ATen/ops/from_blob.h>

#include "core/errors.h"

#ifdef GX_WITH_CUDA
#include "cuda/mapped_host.h"
#endif

namespace gx::torch_layer {

namespace {

void* mapped_pointer(const at::Tensor& host, const c10::Device& device) {
  GX_CHECK(device.is_cuda(), "mapped_device_view: expected a CUDA device, got ", device.str(), ".");
  GX_CHECK(host.device().is_cpu(), "mapped_device_view: expected a CPU tensor, got one on ", host.device().str(), ".");
  GX_CHECK(host.is_contiguous(), "mapped_device_view: the host tensor must be contiguous; call .contiguous() first.");
#ifdef GX_WITH_CUDA
  return mapped_device_pointer(host.data_ptr());
#else
  GX_CHECK(false, "mapped_device_view: this build of gemini_ext has no CUDA support.");
  return nullptr;
#endif
}

}  // namespace

at::Tensor mapped_device_view(const at::Tensor& host, const c10::Device& device) {
  GX_CHECK(!host.device().is_cpu() || host.is_pinned(),
           "mapped_device_view: the host tensor is not in page-locked memory; call .pin_memory() first.");
  void* mapped = mapped_pointer(host, device);
  at::Tensor keep = host;
  return at::from_blob(mapped, host.sizes(), [keep](void*) mutable { keep.reset(); }, host.options().device(device));
}

at::Tensor mapped_chunk_view(const at::Tensor& host, const c10::Device& device) {
  return at::from_blob(mapped_pointer(host, device), host.sizes(), host.options().device(device));
}

}  // namespace gx::torch_layer
