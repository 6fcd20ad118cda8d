#include "torch/optim/cpu_kernel_args.h"

#include "core/errors.h"

namespace gx::torch_layer {

void check_cpu_tensor(const at::Tensor& t, const char* op, const char* name, int64_t numel) {
  GX_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got one on ", t.device().str(),
           ". Move the optimizer state of this chunk to the host or use the device kernel.");
  GX_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous; call .contiguous() first.");
  GX_CHECK(t.numel() == numel, op, ": ", name, " has ", t.numel(), " elements, expected ", numel, " (the param's).");
}

SimdIsa parse_simd_isa(const std::string& isa, const char* op) {
  if (isa.empty()) return best_simd_isa();
  for (SimdIsa candidate : {SimdIsa::kScalar, SimdIsa::kAvx2, SimdIsa::kAvx512})
    if (isa == to_string(candidate)) return candidate;
  GX_CHECK(false, op, " isa: expected '', 'scalar', 'avx2' or 'avx512', got '", isa, "'.");
}

}  // namespace gx::torch_layer
