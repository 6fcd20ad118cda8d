// HostBufferPool: host memory for what the engine keeps on the host outside chunks (activations
// offloaded between a block's forward and its backward: gemini_ext/_engine/activations/), as CPU
// tensors of bytes from a SizeClassPool over the device backend's host resource.
//
// Design note. The memory is the host tier's own kind: page-locked on cuda (copies to and from the
// device run asynchronously) and, like every host page the engine owns, marked MADV_DONTFORK, so
// forked DataLoader workers never share it; a request the host cannot hold is refused with
// OutOfMemoryError before any page is touched (SPEC §5). A buffer is reused by event: it is handed
// out with the streams that will copy into or out of it (raw cudaStream_t values; none on sim);
// the first of them is ordered after the copies of the buffer's previous use, and when the tensor
// is freed (its deleter, on whichever thread drops it) an event is recorded on each of them and the
// slot waits for those before its next use. The host never waits for a copy to reuse a buffer.
// The deleter holds the pool, which holds the context: both outlive every buffer handed out.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/size_class_pool.h"
#include "torch/chunk_views.h"

namespace gx::torch_layer {

class HostBufferPool : public std::enable_shared_from_this<HostBufferPool> {
 public:
  explicit HostBufferPool(std::shared_ptr<DeviceContext> context);

  // A 1-D uint8 CPU tensor of `bytes` (> 0) bytes (contents unspecified), used by `streams`.
  at::Tensor buffer(size_t bytes, const std::vector<uintptr_t>& streams);
  bool has_free_slot(size_t bytes) const { return pool_.has_free_slot(bytes); }
  void release_free() { pool_.release_free(); }
  const SizeClassPool& pool() const { return pool_; }

 private:
  void order_first_use(const std::vector<std::shared_ptr<Event>>& pending, const std::vector<uintptr_t>& streams);
  std::vector<std::shared_ptr<Event>> record_last_uses(const std::vector<uintptr_t>& streams) const;

  std::shared_ptr<DeviceContext> context_;
  int device_index_ = 0;
  SizeClassPool pool_;
};

}  // namespace gx::torch_layer
