// Corrections of an Adam / AdamW step taken in place with a guessed gradient multiplier.
//
// [Note: correcting a speculative Adam step]
// The engine steps a chunk set's fp32 master p, moments m, v during backward, in place, with the
// gradient multiplier guessed as s0 (exactly 1: no clipping), before the real one s1 (the clip
// coefficient c) is known. Writing g for the stored gradient, g0 = s0 g and g1 = s1 g, the step
// with s0 left
//   m' = b1 m + (1 - b1) e0            e0 = g0 (AdamW) or g0 + wd p (Adam's L2 term)
//   v' = b2 v + (1 - b2) e0^2
//   p' = p D - a m' / (sqrt(v') / k + eps)     D = 1 - lr wd (AdamW) or 1, a = lr / (1 - b1^t), k = sqrt(1 - b2^t)
// and the step with s1 would have left the same with e1 = g1 (+ wd p). Both moments are linear in
// what the gradient contributes, so with d = e0 - e1 = (s0 - s1) g:
//   m'' = m' - (1 - b1) d
//   v'' = v' - (1 - b2) (e0^2 - e1^2) = v' - (1 - b2) d (e0 + e1),  clamped at 0
// and the decay term p D is common to both parameters: the step's own relation gives it back,
//   p D = p' + a m' / den(v'),   p'' = p D - a m'' / den(v'')
// (Adam's L2 term needs that parameter for e0 + e1 = (s0 + s1) g + 2 wd p, with D = 1). One pass
// reads p', m', v', g and writes p'', m'', v'' and the 16-bit copy: the bytes of one Adam step.
// Accuracy. m' and v' were rounded once, and the correction cancels part of them: m'' and v'' keep
// an absolute error of about half an ulp of m' and v'. Where the step's gradient dominated v'
// (v' >> v'', a spike c^2 times the running mean square) that is a relative error of v'' of
// 2^-24 v' / v''. Where this is worst, moments that were zero before the step (the first step;
// an embedding row's first gradient; v' / v'' = 1 / c^2), there is no cancellation to make: m'
// and v' are then exactly (1 - b1) e0 and (1 - b2) e0^2 rounded once, which identifies those
// elements (a nonzero m or v that rounding absorbed whole would need a gradient some 10^5 times
// its running RMS), and m'' and v'' are the serial step's own operations on c g, bit for bit; only
// p D carries a rounding. Elsewhere the parameters stay within a few ulps of the serial step's
// (the GoogleTest measures it on warmed-up moments with gradients up to 4 times their RMS); the
// update of an element whose gradient was a spike against a small but nonzero v (v' / v'' large:
// c small, a rare embedding row) is off by up to 2^-25 v' / v'' of itself, which a coefficient of
// 0 (an infinite norm) makes unbounded in principle and about 1e-3 of the learning rate in the
// Python suite's case.
//
// Undoing the step (another backward before step(), a read of the parameters, zero_grad, or
// hyperparameters that changed before step()) inverts the same relations with s0:
//   p D = p' + a m' / den(v'),  m = (m' - (1 - b1) e0) / b1,  v = max(0, v' - (1 - b2) e0^2) / b2
// (m = 0 when b1 = 0 and v = 0 when b2 = 0: the step did not read them; moments that were zero,
// recognised as below, come back as zeros), and the 16-bit copy is rounded from the restored p.
// The step then runs again as the serial one would.
//
// Every path (scalar, AVX2, AVX-512) does the same float operations in the same order
// (adam_correction_kernels.inc), so their results are bit-identical. all_finite() is the check
// that decides whether a set may be stepped before the multiplier is known: a non-finite
// gradient could not be taken back out of m and v.
#pragma once

#include <cstdint>

#include "cpu_adam.h"
#include "cpu_features.h"
#include "core/types.h"

namespace gx {

// The constants of a correction (derived from the step's AdamHyper and the two multipliers).
struct AdamCorrectionConstants {
  AdamConstants step;     // the step that was taken (grad_scale: s0)
  float diff_scale;       // s0 - s1
  float sum_scale;        // s0 + s1
  float true_scale;       // s1
  bool fresh;             // the step was the first (t = 1): m and v were zero, recomputed exactly
  float two_weight_decay; // Adam's L2 term: 2 wd (0 for AdamW)
  bool l2;                // Adam with weight decay: the parameter before the step enters v
  bool undo_m;            // beta1 != 0 (else the step did not read m: undone to 0)
  bool undo_v;            // beta2 != 0 (likewise v)
};

// The step described by `hyper` (its grad_scale the guessed multiplier s0) was taken in place on
// `buffers` (in place: no *_out); make it the step with multiplier `true_multiplier` instead.
// param16, if set, is rewritten from the corrected master.
void adam_correct_step(const AdamHyper& hyper, double true_multiplier, const AdamBuffers& buffers);
void adam_correct_step(const AdamHyper& hyper, double true_multiplier, const AdamBuffers& buffers, SimdIsa isa);

// The step described by `hyper` was taken in place on `buffers`: restore master, m and v to
// what they were before it (within the rounding the Note describes), param16 from the master.
void adam_undo_step(const AdamHyper& hyper, const AdamBuffers& buffers);
void adam_undo_step(const AdamHyper& hyper, const AdamBuffers& buffers, SimdIsa isa);

// Whether every one of `numel` elements of `data` (float32, bfloat16 or float16) is finite;
// over the global ThreadPool.
bool all_finite(const void* data, DType dtype, int64_t numel);

namespace detail {
AdamCorrectionConstants adam_correction_constants(const AdamHyper& hyper, double true_multiplier);
void adam_correct_scalar(const AdamCorrectionConstants& k, const AdamBuffers& b, int64_t begin, int64_t end);
void adam_correct_avx2(const AdamCorrectionConstants& k, const AdamBuffers& b, int64_t begin, int64_t end);
void adam_correct_avx512(const AdamCorrectionConstants& k, const AdamBuffers& b, int64_t begin, int64_t end);
void adam_undo_scalar(const AdamCorrectionConstants& k, const AdamBuffers& b, int64_t begin, int64_t end);
void adam_undo_avx2(const AdamCorrectionConstants& k, const AdamBuffers& b, int64_t begin, int64_t end);
void adam_undo_avx512(const AdamCorrectionConstants& k, const AdamBuffers& b, int64_t begin, int64_t end);
}  // namespace detail

}  // namespace gx
