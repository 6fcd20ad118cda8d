// Communicator: the collectives a sharded chunk needs, over the ranks of one ZeRO group.
//
// Design note.
//  * The core never talks to a network; the torch layer implements this interface over a
//    c10d ProcessGroup (NCCL on GPUs, gloo on CPUs) and the C++ tests over threads. A
//    ChunkManager with a communicator is *sharded*: each tier's copy of a chunk holds only this
//    rank's shard, and compute sees a separate gathered buffer of the whole chunk.
//  * Calls are collective: every rank makes the same calls in the same order with the same
//    sizes. Whoever drives the manager must therefore take the same decisions on every rank
//    whenever they lead to a collective (which chunk to gather, when to reduce); decisions that
//    only move this rank's own shard between tiers may differ between ranks.
//  * Buffers are device-tier memory of the backend (host memory on `sim`). Each call is
//    stream-ordered on `stream` like a copy: it starts after the work submitted to `stream`
//    before it, and work submitted after it sees its result. (On sim's compute stream, the
//    calling thread, the call has completed when it returns.)
//  * Only sums and maxima: averaging is a pre-division by the caller (bf16 sums of gradients
//    must not overflow, and gloo has no AVG).
#pragma once

#include <cstdint>
#include <string>

#include "device_backend.h"
#include "types.h"

namespace gx {

enum class ReduceOp : int8_t { kSum = 0, kMax = 1 };
const char* to_string(ReduceOp op);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int world_size() const = 0;
  virtual int rank() const = 0;
  virtual std::string name() const = 0;  // "nccl", "gloo", "threads", ...

  // full[r * shard_numel, (r + 1) * shard_numel) <- rank r's shard, on every rank.
  virtual void all_gather(const void* shard, void* full, int64_t shard_numel, DType dtype, StreamKind stream) = 0;
  // shard <- op over ranks of full[rank * shard_numel, (rank + 1) * shard_numel).
  virtual void reduce_scatter(const void* full, void* shard, int64_t shard_numel, DType dtype, ReduceOp op,
                              StreamKind stream) = 0;
  // data <- op over ranks of data, in place.
  virtual void all_reduce(void* data, int64_t numel, DType dtype, ReduceOp op, StreamKind stream) = 0;
};

}  // namespace gx
