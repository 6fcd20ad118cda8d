// Argument checks shared by the torch-facing CPU optimizer ops (cpu_adam_op.h, cpu_optim_op.h):
// a tensor the kernel reads or writes as raw memory, and the ISA a caller may force.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "core/kernels/cpu_features.h"

namespace gx::torch_layer {

// UsageError unless `t` is a contiguous CPU tensor of `numel` elements (`op` and `name` name it).
void check_cpu_tensor(const at::Tensor& t, const char* op, const char* name, int64_t numel);
// "" (the best available), "scalar", "avx2" or "avx512"; UsageError naming them otherwise.
SimdIsa parse_simd_isa(const std::string& isa, const char* op);

}  // namespace gx::torch_layer
