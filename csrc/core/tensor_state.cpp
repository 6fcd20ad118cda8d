#include "tensor_state.h"

#include <array>

namespace gx {
namespace {

using S = TensorState;

// kLegal[from][to]; rows and columns follow the enum order FREE, COMPUTE, HOLD, HOLD_AFTER_BWD,
// READY_FOR_REDUCE. The header's design note gives the reason for every true entry.
constexpr std::array<std::array<bool, kNumTensorStates>, kNumTensorStates> kLegal = {{
    //            FREE   COMPUTE HOLD   HOLD_AB READY
    /* FREE    */ {false, false, true, false, false},
    /* COMPUTE */ {false, false, true, true, true},
    /* HOLD    */ {true, true, false, false, true},
    /* HOLD_AB */ {false, true, true, false, true},
    /* READY   */ {false, false, true, false, false},
}};

}  // namespace

const char* to_string(TensorState state) {
  switch (state) {
    case S::kFree: return "FREE";
    case S::kCompute: return "COMPUTE";
    case S::kHold: return "HOLD";
    case S::kHoldAfterBwd: return "HOLD_AFTER_BWD";
    case S::kReadyForReduce: return "READY_FOR_REDUCE";
  }
  return "?";
}

bool is_legal_transition(TensorState from, TensorState to) {
  return kLegal[static_cast<int>(from)][static_cast<int>(to)];
}

IllegalTransition::IllegalTransition(ChunkId chunk_id_, const std::string& tensor_name_, TensorState from_,
                                     TensorState to_)
    : InternalError(detail::concat("gemini_ext internal error (this is a bug, please report it): illegal "
                                   "TensorState transition of tensor '", tensor_name_, "' in chunk ", chunk_id_,
                                   ": ", to_string(from_), " -> ", to_string(to_))),
      chunk_id(chunk_id_),
      tensor_name(tensor_name_),
      from(from_),
      to(to_) {}

void check_transition(ChunkId chunk_id, const std::string& tensor_name, TensorState from, TensorState to) {
  if (!is_legal_transition(from, to)) throw IllegalTransition(chunk_id, tensor_name, from, to);
}

}  // namespace gx
