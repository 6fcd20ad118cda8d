// Mapping between ATen scalar types and the core's DType (the only place that knows both).
#pragma once

#include <ATen/core/Tensor.h>

#include "core/types.h"

namespace gx::torch_layer {

DType to_gx_dtype(at::ScalarType type);
at::ScalarType to_scalar_type(DType dtype);

}  // namespace gx::torch_layer
