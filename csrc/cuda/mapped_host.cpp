#include "cuda/mapped_host.h"

#include <cuda_runtime_api.h>

#include "core/errors.h"
#include "cuda/cuda_backend.h"

namespace gx {

void* mapped_device_pointer(void* host) {
  // cudaPointerGetAttributes answers for any address inside an allocation (a chunk's slot lies
  // inside its arena's registered range), cudaHostGetDevicePointer only for its start.
  cudaPointerAttributes attributes{};
  GX_CUDA_CHECK(cudaPointerGetAttributes(&attributes, host));
  GX_CHECK(attributes.type == cudaMemoryTypeHost && attributes.devicePointer != nullptr,
           "mapped_device_pointer: the address is not page-locked host memory mapped for the device (memory type ",
           static_cast<int>(attributes.type), ").");
  return attributes.devicePointer;
}

}  // namespace gx
