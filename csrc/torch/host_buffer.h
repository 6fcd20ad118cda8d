// host_buffer: a CPU tensor of bytes over the device backend's host memory resource, for what the
// engine keeps on the host outside chunks (activations offloaded between a block's forward and
// its backward: gemini_ext/activations/).
//
// Design note. The memory comes from the same resource as the host tier's chunks: on cuda it is
// page-locked (copies to and from the device run asynchronously) and, like every host page the
// engine owns, marked MADV_DONTFORK, so forked DataLoader workers never share it; a request the
// host cannot hold is refused with OutOfMemoryError before any page is touched (SPEC §5). The
// tensor's deleter gives the bytes back and keeps the backend alive until then.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <memory>

#include "torch/chunk_views.h"

namespace gx::torch_layer {

// A 1-D uint8 CPU tensor of `bytes` (> 0) bytes; its contents are unspecified.
at::Tensor host_buffer(const std::shared_ptr<DeviceContext>& context, size_t bytes);

}  // namespace gx::torch_layer
