// The Adam correction and undo, avx512 path (16 floats per vector): adam_correction_kernels.inc
// instantiated for simd_avx512.h; see adam_correction.h for the contract.
#include "adam_correction.h"

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include "simd_avx512.h"

namespace gx::detail {
namespace correction_avx512 {
#include "adam_correction_kernels.inc"
}  // namespace correction_avx512

void adam_correct_avx512(const AdamCorrectionConstants& k, const AdamBuffers& b, int64_t begin, int64_t end) {
  const int64_t i = correction_avx512::adam_correct_body<simd_avx512::Vec>(k, b, begin, end);
  adam_correct_scalar(k, b, i, end);
}

void adam_undo_avx512(const AdamCorrectionConstants& k, const AdamBuffers& b, int64_t begin, int64_t end) {
  const int64_t i = correction_avx512::adam_undo_body<simd_avx512::Vec>(k, b, begin, end);
  adam_undo_scalar(k, b, i, end);
}

}  // namespace gx::detail

#pragma GCC pop_options
#else
namespace gx::detail {
// Never selected: detected_simd_isa() is scalar off x86.
void adam_correct_avx512(const AdamCorrectionConstants& k, const AdamBuffers& b, int64_t begin, int64_t end) {
  adam_correct_scalar(k, b, begin, end);
}
void adam_undo_avx512(const AdamCorrectionConstants& k, const AdamBuffers& b, int64_t begin, int64_t end) {
  adam_undo_scalar(k, b, begin, end);
}
}  // namespace gx::detail
#endif
