#include "core/activation_plan.h"

#include <algorithm>
#include <limits>

#include "core/errors.h"

namespace gx {

const char* to_string(BlockActivations choice) {
  switch (choice) {
    case BlockActivations::kKeep:
      return "keep";
    case BlockActivations::kRecompute:
      return "recompute";
    case BlockActivations::kOffload:
      return "offload";
  }
  return "?";
}

namespace {

void check_inputs(const ActivationPlanInputs& in) {
  GX_CHECK(in.device_free_bytes >= 0, "plan_activations: device_free_bytes must be >= 0, got ", in.device_free_bytes,
           ".");
  GX_CHECK(in.link_bytes_per_second >= 0, "plan_activations: link_bytes_per_second must be >= 0, got ",
           in.link_bytes_per_second, ".");
  GX_CHECK(in.in_flight >= 1, "plan_activations: in_flight must be >= 1, got ", in.in_flight, ".");
  GX_CHECK(in.allow_keep || in.allow_recompute || in.link_bytes_per_second > 0,
           "plan_activations: no choice is allowed (neither keep nor recompute, and no link to offload over).");
  for (size_t i = 0; i < in.blocks.size(); ++i) {
    const BlockCosts& b = in.blocks[i];
    GX_CHECK(b.activation_bytes >= 0 && b.input_bytes >= 0 && b.forward_seconds >= 0 && b.backward_seconds >= 0,
             "plan_activations: block ", i, " has a negative cost.");
  }
}

// Seconds of one direction's copy that `window_seconds` of compute beside it does not hide.
double exposed_copy_seconds(int64_t bytes, double link_bytes_per_second, double window_seconds) {
  if (link_bytes_per_second <= 0) return std::numeric_limits<double>::infinity();
  return std::max(0.0, static_cast<double>(bytes) / link_bytes_per_second - window_seconds);
}

double block_seconds(const ActivationPlanInputs& in, size_t i, BlockActivations choice) {
  const BlockCosts& b = in.blocks[i];
  switch (choice) {
    case BlockActivations::kKeep:
      return 0.0;
    case BlockActivations::kRecompute:
      return b.forward_seconds;
    case BlockActivations::kOffload:
      return b.forward_seconds + exposed_copy_seconds(b.input_bytes, in.link_bytes_per_second, b.forward_seconds) +
             exposed_copy_seconds(b.input_bytes, in.link_bytes_per_second, b.backward_seconds);
  }
  return 0.0;
}

// What a block keeps on the device until its backward: the move's lasting saving, which ranks the
// moves (the recompute's working set and the copies in flight are paid once, not per block).
int64_t kept_bytes(const BlockCosts& b, BlockActivations choice) {
  switch (choice) {
    case BlockActivations::kKeep:
      return b.activation_bytes;
    case BlockActivations::kRecompute:
      return b.input_bytes;
    case BlockActivations::kOffload:
      return 0;
  }
  return 0;
}

}  // namespace

int64_t activation_device_bytes(const ActivationPlanInputs& in, const std::vector<BlockActivations>& choices) {
  GX_CHECK(choices.size() == in.blocks.size(), "activation_device_bytes: ", choices.size(), " choices for ",
           in.blocks.size(), " blocks.");
  int64_t resident = 0, largest_recomputed = 0;
  std::vector<int64_t> offloaded_inputs;
  for (size_t i = 0; i < choices.size(); ++i) {
    const BlockCosts& b = in.blocks[i];
    if (choices[i] == BlockActivations::kKeep) {
      resident += b.activation_bytes;
      continue;
    }
    largest_recomputed = std::max(largest_recomputed, b.activation_bytes);
    if (choices[i] == BlockActivations::kRecompute)
      resident += b.input_bytes;
    else
      offloaded_inputs.push_back(b.input_bytes);
  }
  std::sort(offloaded_inputs.rbegin(), offloaded_inputs.rend());
  int64_t in_flight = 0;
  for (size_t k = 0; k < offloaded_inputs.size() && k < static_cast<size_t>(in.in_flight); ++k)
    in_flight += offloaded_inputs[k];
  return resident + largest_recomputed + in_flight;
}

double activation_added_seconds(const ActivationPlanInputs& in, const std::vector<BlockActivations>& choices) {
  GX_CHECK(choices.size() == in.blocks.size(), "activation_added_seconds: ", choices.size(), " choices for ",
           in.blocks.size(), " blocks.");
  double total = 0;
  for (size_t i = 0; i < choices.size(); ++i) total += block_seconds(in, i, choices[i]);
  return total;
}

namespace {

bool allowed(const ActivationPlanInputs& in, BlockActivations choice) {
  return choice == BlockActivations::kKeep        ? in.allow_keep
         : choice == BlockActivations::kRecompute ? in.allow_recompute
                                                  : in.link_bytes_per_second > 0;
}

// Moves the greedy may take from `choices`: the one freeing the most bytes per second added, or
// n where none is left (every block keeps as little as it may, or the host has no room for another
// input). Ties go to the larger saving, then to the earlier block.
struct Move {
  size_t block;
  BlockActivations to;
};

Move best_move(const ActivationPlanInputs& in, const std::vector<BlockActivations>& choices,
               int64_t offloaded_bytes) {
  const size_t n = in.blocks.size();
  Move best{n, BlockActivations::kKeep};
  double best_rate = -1;
  int64_t best_freed = 0;
  for (size_t i = 0; i < n; ++i) {
    for (BlockActivations to : {BlockActivations::kRecompute, BlockActivations::kOffload}) {
      if (static_cast<int>(to) <= static_cast<int>(choices[i]) || !allowed(in, to)) continue;
      if (to == BlockActivations::kOffload && in.host_free_bytes >= 0 &&
          offloaded_bytes + in.blocks[i].input_bytes > in.host_free_bytes)
        continue;
      const int64_t freed = kept_bytes(in.blocks[i], choices[i]) - kept_bytes(in.blocks[i], to);
      if (freed <= 0) continue;
      const double added = block_seconds(in, i, to) - block_seconds(in, i, choices[i]);
      const double rate = added <= 0 ? std::numeric_limits<double>::infinity() : static_cast<double>(freed) / added;
      if (rate > best_rate || (rate == best_rate && freed > best_freed)) {
        best = Move{i, to}, best_rate = rate, best_freed = freed;
      }
    }
  }
  return best;
}

int64_t offloaded_input_bytes(const ActivationPlanInputs& in, const std::vector<BlockActivations>& choices) {
  int64_t total = 0;
  for (size_t i = 0; i < choices.size(); ++i)
    if (choices[i] == BlockActivations::kOffload) total += in.blocks[i].input_bytes;
  return total;
}

// An offloaded input the room can hold after all goes back to plain recompute (the same compute,
// nothing over the link or on the host), the last blocks first: their inputs are fetched soonest.
void keep_inputs_the_device_holds(const ActivationPlanInputs& in, std::vector<BlockActivations>& choices) {
  if (!in.allow_recompute) return;
  for (size_t i = choices.size(); i-- > 0;) {
    if (choices[i] != BlockActivations::kOffload) continue;
    choices[i] = BlockActivations::kRecompute;
    if (activation_device_bytes(in, choices) > in.device_free_bytes) choices[i] = BlockActivations::kOffload;
  }
}

}  // namespace

ActivationPlan plan_activations(const ActivationPlanInputs& in) {
  check_inputs(in);
  const BlockActivations first = in.allow_keep        ? BlockActivations::kKeep
                                 : in.allow_recompute ? BlockActivations::kRecompute
                                                      : BlockActivations::kOffload;
  std::vector<BlockActivations> choices(in.blocks.size(), first);
  if (first == BlockActivations::kOffload && in.host_free_bytes >= 0) {  // only what the host can take
    // beyond it a block is still checkpointed (keep is not allowed), its input left on the device
    int64_t offloaded = 0;
    for (size_t i = 0; i < choices.size(); ++i) {
      offloaded += in.blocks[i].input_bytes;
      if (offloaded > in.host_free_bytes) choices[i] = BlockActivations::kRecompute;
    }
  }
  int64_t bytes = activation_device_bytes(in, choices);
  while (bytes > in.device_free_bytes) {
    const Move move = best_move(in, choices, offloaded_input_bytes(in, choices));
    if (move.block == choices.size()) break;  // every block keeps as little as it can
    choices[move.block] = move.to;
    bytes = activation_device_bytes(in, choices);
  }
  ActivationPlan plan;
  plan.fits = bytes <= in.device_free_bytes;
  if (plan.fits) keep_inputs_the_device_holds(in, choices);
  plan.choices = choices;
  plan.device_bytes = activation_device_bytes(in, choices);
  plan.added_seconds = activation_added_seconds(in, choices);
  plan.host_bytes = offloaded_input_bytes(in, choices);
  return plan;
}

}  // namespace gx
