#include "core/hook_phase.h"

#include <array>

#include "core/errors.h"

namespace gx {

namespace {
constexpr uint8_t kIllegal = 0xff;
constexpr auto I = static_cast<uint8_t>(HookPhase::kIdle);
constexpr auto F = static_cast<uint8_t>(HookPhase::kForward);
constexpr auto B = static_cast<uint8_t>(HookPhase::kBackward);
// kTable[event][phase]: the next phase (see the table in hook_phase.h).
constexpr std::array<std::array<uint8_t, 3>, 7> kTable{{
    {F, F, B},         // pre_forward
    {kIllegal, F, B},  // post_forward
    {B, B, B},         // pre_backward
    {I, F, B},         // post_backward
    {I, F, B},         // grad_arrived
    {I, I, I},         // end_backward
    {I, I, B},         // end_iteration
}};
}  // namespace

const char* hook_phase_name(HookPhase phase) {
  switch (phase) {
    case HookPhase::kIdle: return "idle";
    case HookPhase::kForward: return "forward";
    case HookPhase::kBackward: return "backward";
  }
  return "?";
}

const char* hook_event_name(HookEvent event) {
  switch (event) {
    case HookEvent::kPreForward: return "pre_forward";
    case HookEvent::kPostForward: return "post_forward";
    case HookEvent::kPreBackward: return "pre_backward";
    case HookEvent::kPostBackward: return "post_backward";
    case HookEvent::kGradArrived: return "grad_arrived";
    case HookEvent::kEndBackward: return "end_backward";
    case HookEvent::kEndIteration: return "end_iteration";
  }
  return "?";
}

HookPhase next_hook_phase(HookPhase from, HookEvent event) {
  const uint8_t next = kTable[static_cast<size_t>(event)][static_cast<size_t>(from)];
  GX_INTERNAL_ASSERT(next != kIllegal, "hook event ", hook_event_name(event), " in phase ", hook_phase_name(from),
                     " is not a legal transition");
  return static_cast<HookPhase>(next);
}

}  // namespace gx
