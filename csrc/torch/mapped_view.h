// A device tensor over a pinned host tensor's memory (cuda/mapped_host.h): a kernel launched on
// it reads and writes the host memory in place over the link. Used by the optimizer's link lane
// (torch/optim/hybrid_optimizer.h) and its benchmark.
#pragma once

#include <ATen/core/Tensor.h>

namespace gx::torch_layer {

// `host`: a contiguous CPU tensor in page-locked memory; `device`: a CUDA device. The view keeps
// `host` alive.
at::Tensor mapped_device_view(const at::Tensor& host, const c10::Device& device);

// The same over chunk memory the caller keeps alive (the host tiers' arenas are page-locked):
// no reference is kept.
at::Tensor mapped_chunk_view(const at::Tensor& host, const c10::Device& device);

}  // namespace gx::torch_layer
