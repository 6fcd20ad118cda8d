// CPU Adam / AdamW with the moments (m, v) kept in bf16, stochastically rounded.
//
// Design note. An opt-in that trades exactness for memory: m and v take 2 bytes each instead of
// 4, so a set's optimizer side drops from 16 to 12 bytes per parameter with a bf16 gradient and
// an fp32 master (which stays fp32: the update itself is not rounded to bf16). The AVX2 and
// AVX-512 paths do it in one pass per vector (cpu_adam_bf16_moments_kernels.inc): widen m and v,
// the fp32 kernel's operations in its order (adam_update.h), and stochastic rounding
// (stochastic_round.h) whose bits depend on (key, first_index + i) alone: m takes the low 16 bits
// of each element's hash, v the high 16. The scalar path (and the vector paths' tails) widens
// blocks of kBf16MomentsBlockNumel elements into stack scratch, runs the scalar fp32 kernel and
// narrows them back. So the result equals, exactly, the fp32 update of the widened moments
// followed by that rounding, on every ISA and thread count; memory traffic is 20 bytes per
// parameter against the fp32 kernel's 28.
//
// With a bf16 master (Bf16Moments::param, AdamBuffers::param null) the parameter itself is bf16
// and takes the update stochastically rounded too, from its own stream (param_stream_key): 8
// bytes per parameter with its bf16 gradient (parameter, gradient, m, v) and 14 bytes of
// traffic. Opt-in (GeminiConfig.master_weights=False with bf16 moments): it changes the numerics
// further, as an update below half a bf16 step of the weight survives only on average.
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
  // A bf16 master in place of AdamBuffers::param (then null, and param16 too: this is the
  // parameter compute reads), updated in place or, out of place, into param_out.
  uint16_t* param = nullptr;
  uint16_t* param_out = nullptr;
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

namespace detail {
// The buffers and moments of elements [begin, begin + n) (offset pointers and first_index).
AdamBuffers buffers_from(const AdamBuffers& b, int64_t begin, int64_t n);
Bf16Moments moments_from(const Bf16Moments& m, int64_t begin);
// Elements [begin, end), one thread, with a given implementation (bit-identical).
void adam_bf16_moments_scalar(const AdamConstants& c, const AdamBuffers& b, const Bf16Moments& mo, int64_t begin,
                              int64_t end);
void adam_bf16_moments_avx2(const AdamConstants& c, const AdamBuffers& b, const Bf16Moments& mo, int64_t begin,
                            int64_t end);
void adam_bf16_moments_avx512(const AdamConstants& c, const AdamBuffers& b, const Bf16Moments& mo, int64_t begin,
                              int64_t end);
}  // namespace detail

}  // namespace gx
