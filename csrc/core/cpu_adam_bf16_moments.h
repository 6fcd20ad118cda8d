// CPU Adam / AdamW with the moments (m, v) kept in bf16, stochastically rounded.
//
// Design note. An opt-in that trades exactness for memory: m and v take 2 bytes each instead of
// 4, so a set's optimizer side drops from 16 to 12 bytes per parameter with a bf16 gradient and
// an fp32 master (which stays fp32: the update itself is not rounded to bf16). Each block of
// kBlockNumel elements is widened into fp32 scratch on the thread's stack, updated by the same
// fp32 kernel as cpu_adam_step (cpu_adam_range, every ISA, bit for bit), and narrowed back with
// stochastic rounding (stochastic_round.h, with the same ISA as the update) whose bits depend on
// (key, first_index + i) alone: m takes the low 16 bits of each element's hash, v the high 16.
// So the result equals, exactly, the fp32 update of the widened moments followed by that
// rounding, on every ISA and thread count; the scratch stays in cache, so memory traffic is
// 20 bytes per parameter against the fp32 kernel's 28.
#pragma once

#include <cstdint>

#include "cpu_adam.h"

namespace gx {

struct Bf16Moments {
  uint16_t* exp_avg = nullptr;
  uint16_t* exp_avg_sq = nullptr;
  // Out of place (both or none; with AdamBuffers::param_out): written instead of the inputs.
  uint16_t* exp_avg_out = nullptr;
  uint16_t* exp_avg_sq_out = nullptr;
  uint32_t key = 0;          // the step's and chunk's key (stochastic_key)
  uint32_t first_index = 0;  // index of element 0 in the random streams (a shard's offset)
};

constexpr int64_t kBf16MomentsBlockNumel = 2048;

// Validates buffers, moments and hyperparameters (UsageError naming the bad one).
void check_adam_bf16_moments_args(const AdamHyper& hyper, const AdamBuffers& buffers, const Bf16Moments& moments);

// One update of all elements over the global ThreadPool. `buffers` gives the master, gradient,
// optional 16-bit parameter copy and param_out; its exp_avg fields must be null (the moments
// come in `moments`).
void cpu_adam_step_bf16_moments(const AdamHyper& hyper, const AdamBuffers& buffers, const Bf16Moments& moments,
                                SimdIsa isa);
void cpu_adam_step_bf16_moments(const AdamHyper& hyper, const AdamBuffers& buffers, const Bf16Moments& moments);

}  // namespace gx
