#include "cuda/adam_kernel.h"

#include <type_traits>

#include "core/errors.h"
#include "core/kernels/half_convert.h"
#include "core/kernels/stochastic_round.h"
#include "cuda/cuda_backend.h"

namespace gx {
namespace {

// Compile-time element formats: the loads and stores of one kernel instantiation.
struct F32 {};
struct Bf16 {};
struct F16 {};
struct None {};

__device__ inline float load_as_float(const float* p, int64_t i, F32) { return p[i]; }
__device__ inline float load_as_float(const uint16_t* p, int64_t i, Bf16) { return bf16_to_float(p[i]); }
__device__ inline float load_as_float(const uint16_t* p, int64_t i, F16) { return fp16_to_float(p[i]); }

template <typename Format>
struct Storage {
  using type = uint16_t;
};
template <>
struct Storage<F32> {
  using type = float;
};

__device__ inline void store_param16(uint16_t* p, int64_t i, float x, Bf16) { p[i] = float_to_bf16(x); }
__device__ inline void store_param16(uint16_t* p, int64_t i, float x, F16) { p[i] = float_to_fp16(x); }
__device__ inline void store_param16(uint16_t*, int64_t, float, None) {}

__device__ inline void store_master(float* p, int64_t i, float x, uint32_t, F32) { p[i] = x; }
__device__ inline void store_master(uint16_t* p, int64_t i, float x, uint32_t bits, Bf16) {
  p[i] = float_to_bf16_stochastic(x, bits);
}

template <typename GradFormat, typename StateFormat, typename Param16Format, typename MasterFormat>
__global__ void adam_kernel(AdamConstants c, typename Storage<MasterFormat>::type* __restrict__ param,
                            typename Storage<StateFormat>::type* __restrict__ exp_avg,
                            typename Storage<StateFormat>::type* __restrict__ exp_avg_sq,
                            const typename Storage<GradFormat>::type* __restrict__ grad,
                            uint16_t* __restrict__ param16, int64_t n, uint32_t key, uint32_t first_index) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float g = load_as_float(grad, i, GradFormat{});
    float p = load_as_float(param, i, MasterFormat{});
    float m = load_as_float(exp_avg, i, StateFormat{});
    float v = load_as_float(exp_avg_sq, i, StateFormat{});
    adam_update_element(c, g, p, m, v);
    if constexpr (std::is_same_v<MasterFormat, F32>) {
      param[i] = p;
    } else {
      store_master(param, i, p, stochastic_bits(param_stream_key(key), first_index + static_cast<uint32_t>(i)),
                   MasterFormat{});
    }
    if constexpr (std::is_same_v<StateFormat, F32>) {
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
    } else {
      const uint32_t bits = stochastic_bits(key, first_index + static_cast<uint32_t>(i));
      exp_avg[i] = float_to_bf16_stochastic(m, bits);
      exp_avg_sq[i] = float_to_bf16_stochastic(v, bits >> 16);
    }
    store_param16(param16, i, p, Param16Format{});
  }
}

template <typename GradFormat, typename StateFormat, typename Param16Format, typename MasterFormat = F32>
void launch(const AdamConstants& c, const DeviceAdamBuffers& b, cudaStream_t stream) {
  using Master = typename Storage<MasterFormat>::type;
  using State = typename Storage<StateFormat>::type;
  using Grad = typename Storage<GradFormat>::type;
  constexpr int kThreads = 256;
  const int64_t wanted = (b.numel + kThreads - 1) / kThreads;
  const int64_t most = b.max_blocks > 0 ? b.max_blocks : 4096;  // grid-stride beyond ~1M threads
  const int blocks = static_cast<int>(wanted < most ? wanted : most);
  adam_kernel<GradFormat, StateFormat, Param16Format, MasterFormat><<<blocks, kThreads, 0, stream>>>(
      c, static_cast<Master*>(b.param), static_cast<State*>(b.exp_avg), static_cast<State*>(b.exp_avg_sq),
      static_cast<const Grad*>(b.grad), static_cast<uint16_t*>(b.param16), b.numel, b.random_key, b.first_index);
  GX_CUDA_CHECK(cudaGetLastError());
}

template <typename GradFormat, typename StateFormat>
void launch_with_param16(const AdamConstants& c, const DeviceAdamBuffers& b, cudaStream_t stream) {
  if (b.param16 == nullptr) return launch<GradFormat, StateFormat, None>(c, b, stream);
  if (b.param16_dtype == DType::kBFloat16) return launch<GradFormat, StateFormat, Bf16>(c, b, stream);
  GX_INTERNAL_ASSERT(b.param16_dtype == DType::kFloat16, "param16 dtype ", to_string(b.param16_dtype));
  launch<GradFormat, StateFormat, F16>(c, b, stream);
}

template <typename GradFormat>
void launch_with_states(const AdamConstants& c, const DeviceAdamBuffers& b, cudaStream_t stream) {
  if (b.master_dtype == DType::kBFloat16) {  // the 8-byte state: bf16 master and moments, no copy
    GX_INTERNAL_ASSERT(b.state_dtype == DType::kBFloat16 && b.param16 == nullptr,
                       "a bf16 master needs bf16 moments and no param16");
    return launch<GradFormat, Bf16, None, Bf16>(c, b, stream);
  }
  GX_INTERNAL_ASSERT(b.master_dtype == DType::kFloat32, "master dtype ", to_string(b.master_dtype));
  if (b.state_dtype == DType::kFloat32) return launch_with_param16<GradFormat, F32>(c, b, stream);
  GX_INTERNAL_ASSERT(b.state_dtype == DType::kBFloat16, "state dtype ", to_string(b.state_dtype));
  launch_with_param16<GradFormat, Bf16>(c, b, stream);
}

}  // namespace

void adam_step_on_device(const AdamConstants& c, const DeviceAdamBuffers& b, cudaStream_t stream) {
  if (b.numel == 0) return;
  switch (b.grad_dtype) {
    case DType::kFloat32: return launch_with_states<F32>(c, b, stream);
    case DType::kBFloat16: return launch_with_states<Bf16>(c, b, stream);
    case DType::kFloat16: return launch_with_states<F16>(c, b, stream);
    default:
      GX_INTERNAL_ASSERT(false, "grad dtype ", to_string(b.grad_dtype));
  }
}

}  // namespace gx
