// The SIMD implementations this CPU can run, for tests that compare them.
#pragma once

#include <vector>

#include "core/kernels/cpu_features.h"

namespace gx {

inline std::vector<SimdIsa> available_isas() {
  std::vector<SimdIsa> out{SimdIsa::kScalar};
  if (static_cast<int>(detected_simd_isa()) >= static_cast<int>(SimdIsa::kAvx2)) out.push_back(SimdIsa::kAvx2);
  if (detected_simd_isa() == SimdIsa::kAvx512) out.push_back(SimdIsa::kAvx512);
  return out;
}

}  // namespace gx
