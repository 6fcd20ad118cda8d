// Adam / AdamW on the device in one pass: the device side of csrc/core/kernels/cpu_adam.h.
//
// Design note. One kernel reads the gradient in its compute dtype, the fp32 master and the
// moments (fp32, or bf16 with the stochastic rounding of core/kernels/stochastic_round.h), and writes the
// master, the moments and the 16-bit copy for compute: 28 bytes per parameter with bf16
// gradients and fp32 moments, 20 with bf16 moments, 14 with a bf16 master as well (rounded
// stochastically from its own stream, as the CPU kernel does). torch's fused kernel needs the gradient in
// fp32 and the 16-bit copy written by separate passes (40 bytes). Each element is updated by
// core/kernels/adam_update.h's function with correctly rounded intrinsics and narrowed by the same
// inline conversions as the CPU loops, so the results equal the CPU kernel's bit for bit.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/kernels/adam_update.h"
#include "core/types.h"

namespace gx {

// One run of a chunk on the device: every pointer on the current device, `numel` elements each.
struct DeviceAdamBuffers {
  void* param = nullptr;       // the master, updated in place: float32, or bfloat16 (master_dtype)
  DType master_dtype = DType::kFloat32;  // bfloat16 only with bf16 moments and no param16
  void* exp_avg = nullptr;     // m and v: float32, or both bfloat16 (state_dtype)
  void* exp_avg_sq = nullptr;
  DType state_dtype = DType::kFloat32;
  const void* grad = nullptr;  // float32, bfloat16 or float16
  DType grad_dtype = DType::kFloat32;
  void* param16 = nullptr;     // optional bf16 / fp16 copy of the updated master
  DType param16_dtype = DType::kBFloat16;
  int64_t numel = 0;
  // bf16 moments: element i draws stochastic_bits(random_key, first_index + i), m the low half; a
  // bf16 master the low half of stochastic_bits(param_stream_key(random_key), first_index + i).
  uint32_t random_key = 0;
  uint32_t first_index = 0;
  // A cap on the kernel's blocks (0: enough for the whole device). The optimizer's link lane runs
  // beside compute: a few blocks keep the link busy and leave the SMs to compute's kernels.
  int max_blocks = 0;
};

// Launches the update on `stream` (asynchronous). The dtypes must be among those named above
// (the caller validates; another is a bug: InternalError).
void adam_step_on_device(const AdamConstants& constants, const DeviceAdamBuffers& buffers, cudaStream_t stream);

}  // namespace gx
