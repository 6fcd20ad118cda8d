// TensorState: the lifecycle of one tensor inside a chunk, as an explicit transition table.
//
// Design note. The states:
//   FREE             the tensor has no payload in the chunk (not yet registered, or dropped).
//   HOLD             the payload is valid and nobody computes with it; the chunk may move.
//   COMPUTE          a forward or backward computation reads it; the chunk must stay gathered
//                    on the device and may not move.
//   HOLD_AFTER_BWD   backward used it and its gradient is not (yet) in the chunk.
//   READY_FOR_REDUCE its gradient is in the chunk, waiting for the chunk-wide reduction.
//
// Legal transitions, and why each exists:
//   FREE             -> HOLD              registration filled the payload
//   HOLD             -> FREE              the tensor is unregistered (engine closed)
//   HOLD             -> COMPUTE           pre-forward or pre-backward access
//   HOLD             -> READY_FOR_REDUCE  a gradient arrived without a backward pre-hook
//                                         (a parameter used outside a hooked module)
//   COMPUTE          -> HOLD              post-forward release
//   COMPUTE          -> HOLD_AFTER_BWD    post-backward release, gradient still pending
//   COMPUTE          -> READY_FOR_REDUCE  the gradient landed while the module still computes
//   HOLD_AFTER_BWD   -> COMPUTE           used again later in the same backward (tied weights)
//   HOLD_AFTER_BWD   -> READY_FOR_REDUCE  the gradient landed after the module finished
//   HOLD_AFTER_BWD   -> HOLD              end of backward: no gradient came (unused, frozen)
//   READY_FOR_REDUCE -> HOLD              the chunk was reduced
// Everything else, identity included, is illegal: it means the scheduler lost track of the
// tensor, so check_transition throws IllegalTransition (an InternalError) naming the chunk,
// the tensor and both states. Nothing is ever silently ignored.
#pragma once

#include <cstdint>
#include <string>

#include "errors.h"
#include "types.h"

namespace gx {

enum class TensorState : int8_t { kFree = 0, kCompute = 1, kHold = 2, kHoldAfterBwd = 3, kReadyForReduce = 4 };
constexpr int kNumTensorStates = 5;

const char* to_string(TensorState state);

// True when `from -> to` is in the table above.
bool is_legal_transition(TensorState from, TensorState to);

class IllegalTransition : public InternalError {
 public:
  IllegalTransition(ChunkId chunk_id, const std::string& tensor_name, TensorState from, TensorState to);
  ChunkId chunk_id;
  std::string tensor_name;
  TensorState from;
  TensorState to;
};

// Throws IllegalTransition when the move is not in the table.
void check_transition(ChunkId chunk_id, const std::string& tensor_name, TensorState from, TensorState to);

}  // namespace gx
