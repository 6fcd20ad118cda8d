// CPU Adam, AVX-512 (F, BW) path (16 floats per step): cpu_adam_kernels.inc instantiated
// for simd_avx512.h; see cpu_adam.h for the contract.
#include "cpu_adam.h"

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include "simd_avx512.h"

namespace gx::detail {
namespace adam_avx512 {
#include "cpu_adam_kernels.inc"
}  // namespace adam_avx512

void cpu_adam_avx512(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end) {
  adam_avx512::adam_fp32<simd_avx512::Vec>(c, b, begin, end);
}

}  // namespace gx::detail

#pragma GCC pop_options
#else
namespace gx::detail {
void cpu_adam_avx512(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end) {
  cpu_adam_scalar(c, b, begin, end);  // never selected: detected_simd_isa() is scalar off x86
}
}  // namespace gx::detail
#endif
