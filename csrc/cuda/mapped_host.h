// Mapped host memory: the device's address of page-locked host memory, for kernels that read and
// write host-resident buffers in place over the host link (zero-copy).
//
// Design note. Page-locked memory, from cudaHostAlloc or from cudaHostRegister with the default
// flags on a system with unified addressing, is mapped into every device's address space;
// cudaHostGetDevicePointer gives the address a kernel uses. A kernel's loads and stores to it
// then cross the link as its own requests, without a staging copy or device memory: the
// optimizer's link lane (torch/optim/hybrid_optimizer.h) steps host-resident optimizer state this
// way, beside the CPU. Memory that is not page-locked has no such address: CudaError.
#pragma once

namespace gx {

void* mapped_device_pointer(void* host);

}  // namespace gx
