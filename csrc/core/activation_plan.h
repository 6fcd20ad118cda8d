// ActivationPlan: for each block of a model, keep its activations on the device, recompute them
// from its input in backward (checkpointing), or recompute them with the input itself offloaded
// to the host between the block's forward and its backward; a pure function of measured costs.
//
// Design note.
//  * Memory. Activations of every block coexist at the end of the forward, so the device bytes
//    of a plan are the sum over blocks of what each keeps there (kKeep: its activations; kRecompute:
//    its input; kOffload: nothing), plus, once any block recomputes, the largest activations of a
//    recomputed block (its recompute materialises them during backward), plus the inputs of the
//    offloaded blocks in flight (`in_flight` of the largest: copies leaving in forward, fetched
//    ahead in backward).
//  * Time. Recomputing costs the block's forward again. An offload also costs the part of its two
//    copies (input bytes over the link, each way) that the neighbouring compute does not hide:
//    the device-to-host copy runs beside the next block's forward, the host-to-device copy beside
//    the later block's backward, both approximated by this block's own times (blocks repeat).
//  * Choice. Start with every block kept; while the plan exceeds `device_free_bytes`, take the move that
//    frees the most bytes per second added (a move that adds nothing first, the larger first), among
//    keep -> recompute, keep -> offload and recompute -> offload, ties to the earlier block. A move
//    is ranked by what the block itself stops keeping; the recompute's working set and the copies
//    in flight, paid once, count only in whether the plan fits. The
//    greedy is exact when blocks are alike (the usual case: a transformer's layers) and close
//    otherwise. If even every block offloaded exceeds the room, the plan says it does not fit and
//    gives every block the least memory it allows (offloaded where the link allows it). The choices
//    allowed narrow the moves: without kKeep the plan starts from every block recomputed, without
//    kRecompute a block leaves kKeep only to be offloaded.
//  * The link and the host are not free. Hidden copies make an offload cost what a recompute costs
//    while freeing a little more, so the greedy may offload where recomputing would have fitted; a
//    plan that fits then takes back to plain recompute every offloaded input the room holds (the
//    last blocks first: their inputs are needed soonest), since the copies share the link with the
//    chunks' own traffic and the inputs take host memory. Offloaded inputs never exceed
//    `host_free_bytes` (the host memory left for them): beyond it a block stays on the device,
//    recomputed from its input there where it may not be kept (kRecompute: what the runtime does
//    with an input the host refuses, even where plain recompute is not a choice).
// Same inputs, same plan, on every rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gx {

enum class BlockActivations : uint8_t { kKeep = 0, kRecompute = 1, kOffload = 2 };

const char* to_string(BlockActivations choice);

struct BlockCosts {
  int64_t activation_bytes = 0;  // what the block keeps without checkpointing (its saved tensors)
  int64_t input_bytes = 0;       // what it keeps under checkpointing (its input)
  double forward_seconds = 0;    // its forward: the cost of a recompute
  double backward_seconds = 0;   // its backward, recompute excluded
};

struct ActivationPlanInputs {
  std::vector<BlockCosts> blocks;    // in forward order
  int64_t device_free_bytes = 0;     // device bytes activations may take
  double link_bytes_per_second = 0;  // host <-> device copies (0: no offload)
  int in_flight = 2;                 // offloaded inputs on the device at once (prefetch depth)
  bool allow_keep = true;            // false: every block is checkpointed
  bool allow_recompute = true;       // false: a checkpointed block's input always goes to the host
  int64_t host_free_bytes = -1;      // what offloaded inputs may take on the host (-1: no limit)
};

struct ActivationPlan {
  std::vector<BlockActivations> choices;
  int64_t device_bytes = 0;  // the plan's activation bytes on the device at their peak
  double added_seconds = 0;  // recomputes plus copies not hidden, per iteration
  bool fits = true;          // device_bytes <= device_free_bytes
  int64_t host_bytes = 0;    // the offloaded inputs' bytes on the host
};

// The plan's device bytes and added time for given choices (the cost model above).
int64_t activation_device_bytes(const ActivationPlanInputs& in, const std::vector<BlockActivations>& choices);
double activation_added_seconds(const ActivationPlanInputs& in, const std::vector<BlockActivations>& choices);

ActivationPlan plan_activations(const ActivationPlanInputs& in);

}  // namespace gx
