#include "torch/dtype_map.h"

#include "core/errors.h"

namespace gx::torch_layer {

DType to_gx_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kDouble: return DType::kFloat64;
    case at::kLong: return DType::kInt64;
    case at::kInt: return DType::kInt32;
    case at::kByte: return DType::kUInt8;
    default: break;
  }
  GX_CHECK(false, "dtype: chunks hold float32, float16, bfloat16, float64, int64, int32 or uint8 tensors; got ",
           c10::toString(type), ". Convert the tensor or keep it out of the engine.");
}

at::ScalarType to_scalar_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return at::kFloat;
    case DType::kFloat16: return at::kHalf;
    case DType::kBFloat16: return at::kBFloat16;
    case DType::kFloat64: return at::kDouble;
    case DType::kInt64: return at::kLong;
    case DType::kInt32: return at::kInt;
    case DType::kUInt8: return at::kByte;
  }
  GX_INTERNAL_ASSERT(false, "unknown DType");
}

}  // namespace gx::torch_layer
