// CPU SGD / Lion / Adagrad, AVX-512 (F, BW) path (16 floats per vector); see cpu_optim.h.
#include "cpu_optim.h"

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include "simd_avx512.h"

namespace gx::detail {
namespace optim_avx512 {
#include "cpu_optim_kernels.inc"
}  // namespace optim_avx512

void cpu_optim_avx512(CpuOptimizer kind, const CpuOptimConstants& c, const CpuOptimBuffers& b, int64_t begin,
                    int64_t end) {
  const int64_t i = optim_avx512::optim_body<simd_avx512::Vec>(kind, c, b, begin, end);
  cpu_optim_scalar(kind, c, b, i, end);
}

}  // namespace gx::detail

#pragma GCC pop_options
#else
namespace gx::detail {
void cpu_optim_avx512(CpuOptimizer kind, const CpuOptimConstants& c, const CpuOptimBuffers& b, int64_t begin,
                    int64_t end) {
  cpu_optim_scalar(kind, c, b, begin, end);  // never selected: detected_simd_isa() is scalar off x86
}
}  // namespace gx::detail
#endif
