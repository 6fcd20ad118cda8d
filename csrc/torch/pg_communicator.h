// ProcessGroupCommunicator: the core's Communicator over a torch.distributed ProcessGroup.
//
// Design note.
//  * The user's ProcessGroup (NCCL on GPUs, gloo on CPUs and the sim device) is passed from
//    Python as the c10d object itself; collectives are issued from C++ on views (from_blob) of
//    chunk memory, so no tensor is copied on the way in or out.
//  * Stream order. A collective is issued with the requested backend stream as torch's current
//    stream and then waited on with `Work::wait()`: for NCCL that makes the current stream wait
//    for the collective's stream (the host does not block), so the call is ordered like a copy
//    on that stream; for gloo, wait() blocks the host until the data is there, which is what
//    the sim device's compute stream (the calling thread) means anyway.
//  * Reduce-scatter: ProcessGroups without a flat reduce-scatter (older gloo) get an all-reduce
//    of the whole buffer followed by a copy of this rank's slice; the first refusal is
//    remembered.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <string>

#include "core/communicator.h"
#include "torch/chunk_views.h"

namespace gx::torch_layer {

class ProcessGroupCommunicator final : public Communicator {
 public:
  ProcessGroupCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group, std::shared_ptr<DeviceContext> ctx);
  int world_size() const override { return world_size_; }
  int rank() const override { return rank_; }
  std::string name() const override { return name_; }

  void all_gather(const void* shard, void* full, int64_t shard_numel, DType dtype, StreamKind stream) override;
  void reduce_scatter(const void* full, void* shard, int64_t shard_numel, DType dtype, ReduceOp op,
                      StreamKind stream) override;
  void all_reduce(void* data, int64_t numel, DType dtype, ReduceOp op, StreamKind stream) override;

  int64_t calls() const { return calls_; }  // collectives issued, for tests and stats

 private:
  at::Tensor device_view(const void* ptr, int64_t numel, DType dtype) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::shared_ptr<DeviceContext> ctx_;
  int world_size_;
  int rank_;
  std::string name_;
  bool flat_reduce_scatter_ = true;
  int64_t calls_ = 0;
};

}  // namespace gx::torch_layer
