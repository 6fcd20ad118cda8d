#include "types.h"

#include "errors.h"

namespace gx {

size_t element_size_bytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat64: return 8;
    case DType::kInt64: return 8;
    case DType::kInt32: return 4;
    case DType::kUInt8: return 1;
  }
  GX_INTERNAL_ASSERT(false, "unknown DType ", static_cast<int>(dtype));
}

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kInt64: return "int64";
    case DType::kInt32: return "int32";
    case DType::kUInt8: return "uint8";
  }
  return "?";
}

DType dtype_from_string(const std::string& name) {
  for (DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64, DType::kInt64,
                  DType::kInt32, DType::kUInt8}) {
    if (name == to_string(d)) return d;
  }
  GX_CHECK(false, "dtype: expected one of float32, float16, bfloat16, float64, int64, int32, uint8; got '",
           name, "'. Pass a floating or integer dtype that chunks can hold.");
}

const char* to_string(Tier tier) {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kPinnedHost: return "pinned_host";
    case Tier::kPageableHost: return "pageable_host";
  }
  return "?";
}

std::string TierSet::to_string() const {
  std::string out;
  for (int i = 0; i < kNumTiers; ++i) {
    if (contains(static_cast<Tier>(i))) {
      if (!out.empty()) out += "+";
      out += gx::to_string(static_cast<Tier>(i));
    }
  }
  return out.empty() ? "none" : out;
}

}  // namespace gx
