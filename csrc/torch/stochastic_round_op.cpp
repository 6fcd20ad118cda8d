#include "torch/stochastic_round_op.h"

#ifdef GX_WITH_CUDA
#include <c10/cuda/CUDAStream.h>

#include "cuda/stochastic_round_kernel.h"
#endif

#include "core/errors.h"
#include "core/stochastic_round.h"

namespace gx::torch_layer {

void narrow_to_bf16_stochastic(const at::Tensor& x, const at::Tensor& out, uint32_t key, uint32_t first_index,
                               DrawHalf half) {
  GX_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kBFloat16,
           "stochastic rounding: expected float32 in and bfloat16 out, got ", c10::toString(x.scalar_type()), " and ",
           c10::toString(out.scalar_type()), ".");
  GX_CHECK(x.is_contiguous() && out.is_contiguous() && x.numel() == out.numel() && x.device() == out.device(),
           "stochastic rounding: expected contiguous tensors of the same numel on one device.");
  const auto* in = x.data_ptr<float>();
  auto* dst = static_cast<uint16_t*>(out.data_ptr());
  if (x.device().is_cpu()) {
    gx::narrow_to_bf16_stochastic(in, dst, x.numel(), key, first_index, half);
    return;
  }
#ifdef GX_WITH_CUDA
  if (x.device().is_cuda()) {
    narrow_to_bf16_stochastic_on_device(in, dst, x.numel(), key, first_index, static_cast<int>(half),
                                        c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    return;
  }
#endif
  GX_CHECK(false, "stochastic rounding: tensors on ", x.device().str(), " are not supported (cpu or cuda).");
}

}  // namespace gx::torch_layer
