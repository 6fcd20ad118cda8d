#include "cpu_features.h"

#include <cstdlib>
#include <cstring>

#include "core/errors.h"

namespace gx {

const char* to_string(SimdIsa isa) {
  switch (isa) {
    case SimdIsa::kScalar: return "scalar";
    case SimdIsa::kAvx2: return "avx2";
    case SimdIsa::kAvx512: return "avx512";
  }
  return "?";
}

SimdIsa detected_simd_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  // Both SIMD paths also convert with F16C, which every AVX2 and AVX-512 CPU has in practice.
  const bool f16c = __builtin_cpu_supports("f16c");
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && f16c) return SimdIsa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) return SimdIsa::kAvx2;
#endif
  return SimdIsa::kScalar;
}

SimdIsa best_simd_isa() {
  const SimdIsa detected = detected_simd_isa();
  const char* cap = std::getenv("GEMINI_EXT_SIMD");
  if (cap == nullptr || *cap == '\0') return detected;
  SimdIsa wanted = SimdIsa::kScalar;
  if (std::strcmp(cap, "avx512") == 0) wanted = SimdIsa::kAvx512;
  else if (std::strcmp(cap, "avx2") == 0) wanted = SimdIsa::kAvx2;
  else GX_CHECK(std::strcmp(cap, "scalar") == 0, "GEMINI_EXT_SIMD: expected scalar, avx2 or avx512, got '", cap,
                "'. Unset it to use the best the CPU has.");
  GX_CHECK(static_cast<int>(wanted) <= static_cast<int>(detected), "GEMINI_EXT_SIMD=", cap,
           ", but this CPU supports at most ", to_string(detected), ". Ask for ", to_string(detected), " or less.");
  return wanted;
}

std::string cpu_feature_summary() {
  std::string out;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  auto add = [&](const char* name, bool present) {
    if (!present) return;
    if (!out.empty()) out += ' ';
    out += name;
  };
  add("avx512f", __builtin_cpu_supports("avx512f"));
  add("avx512bw", __builtin_cpu_supports("avx512bw"));
  add("avx512bf16", __builtin_cpu_supports("avx512bf16"));
  add("avx2", __builtin_cpu_supports("avx2"));
  add("fma", __builtin_cpu_supports("fma"));
#endif
  return out.empty() ? "none" : out;
}

}  // namespace gx
