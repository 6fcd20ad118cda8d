// HookPhase: where the training iteration stands, as the module hooks see it.
//
// Design note. The manager's hook bodies behave differently inside backward: a forward that
// runs there is activation checkpointing's recomputation (the tensors its pre-backward hook
// claimed stay in COMPUTE for that backward), and forward reference counts are not kept. The
// phase is one value that every hook event moves through an explicit table:
//
//   event \ phase   idle       forward    backward
//   pre_forward     forward    forward    backward   (a recomputation inside backward)
//   post_forward    (illegal)  forward    backward
//   pre_backward    backward   backward   backward
//   post_backward   idle       forward    backward   (no change)
//   grad_arrived    idle       forward    backward   (no change: gradients may arrive without a
//                                                      hooked module, e.g. existing .grad at enable)
//   end_backward    idle       idle       idle
//   end_iteration   idle       idle       backward   (a backward that raised ends first: hooks.py)
//
// An illegal event is a bug in the hook wiring and raises InternalError naming both.
// Modelled on FSDP2's TrainingState.
#pragma once

#include <cstdint>

namespace gx {

enum class HookPhase : uint8_t { kIdle, kForward, kBackward };
enum class HookEvent : uint8_t {
  kPreForward,
  kPostForward,
  kPreBackward,
  kPostBackward,
  kGradArrived,
  kEndBackward,
  kEndIteration
};

const char* hook_phase_name(HookPhase phase);
const char* hook_event_name(HookEvent event);
// The phase after `event` in `from` (the table above); InternalError for an illegal event.
HookPhase next_hook_phase(HookPhase from, HookEvent event);

}  // namespace gx
