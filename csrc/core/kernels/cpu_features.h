// CPU features: which SIMD instruction set the host supports, detected at run time.
//
// Design note. Kernels on raw pointers (CPU Adam) are compiled once per ISA
// and picked at run time from `best_simd_isa()`, so one wheel runs on any x86-64 host and uses
// AVX-512 where the host has it. `GEMINI_EXT_SIMD=scalar|avx2|avx512` caps the choice (tests use
// it to cover every path on one machine); asking for more than the host has is refused.
#pragma once

#include <string>

namespace gx {

enum class SimdIsa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

const char* to_string(SimdIsa isa);
SimdIsa detected_simd_isa();  // what the CPU supports
SimdIsa best_simd_isa();      // detected, capped by GEMINI_EXT_SIMD if set
std::string cpu_feature_summary();  // e.g. "avx512f avx512bw avx512_bf16 avx2 fma"

}  // namespace gx
