// The Adam correction and undo, avx2 path (8 floats per vector): adam_correction_kernels.inc
// instantiated for simd_avx2.h; see adam_correction.h for the contract.
#include "adam_correction.h"

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "simd_avx2.h"

namespace gx::detail {
namespace correction_avx2 {
#include "adam_correction_kernels.inc"
}  // namespace correction_avx2

void adam_correct_avx2(const AdamCorrectionConstants& k, const AdamBuffers& b, int64_t begin, int64_t end) {
  const int64_t i = correction_avx2::adam_correct_body<simd_avx2::Vec>(k, b, begin, end);
  adam_correct_scalar(k, b, i, end);
}

void adam_undo_avx2(const AdamCorrectionConstants& k, const AdamBuffers& b, int64_t begin, int64_t end) {
  const int64_t i = correction_avx2::adam_undo_body<simd_avx2::Vec>(k, b, begin, end);
  adam_undo_scalar(k, b, i, end);
}

}  // namespace gx::detail

#pragma GCC pop_options
#else
namespace gx::detail {
// Never selected: detected_simd_isa() is scalar off x86.
void adam_correct_avx2(const AdamCorrectionConstants& k, const AdamBuffers& b, int64_t begin, int64_t end) {
  adam_correct_scalar(k, b, begin, end);
}
void adam_undo_avx2(const AdamCorrectionConstants& k, const AdamBuffers& b, int64_t begin, int64_t end) {
  adam_undo_scalar(k, b, begin, end);
}
}  // namespace gx::detail
#endif
