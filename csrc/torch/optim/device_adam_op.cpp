#include "torch/optim/device_adam_op.h"

#ifdef GX_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/adam_kernel.h"
#endif

#include "core/errors.h"
#include "torch/dtype_map.h"

namespace gx::torch_layer {

namespace {

void check_device_tensor(const at::Tensor& t, const char* name, const at::Tensor& param) {
  GX_CHECK(t.device() == param.device(), "device_adam_step: ", name, " is on ", t.device().str(),
           ", expected the param's device ", param.device().str(), ".");
  GX_CHECK(t.is_contiguous(), "device_adam_step: ", name, " must be contiguous; call .contiguous() first.");
  GX_CHECK(t.numel() == param.numel(), "device_adam_step: ", name, " has ", t.numel(), " elements, expected ",
           param.numel(), " (the param's).");
}

}  // namespace

void device_adam_step(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                      const at::Tensor& grad, const std::optional<at::Tensor>& param16, const AdamHyper& hyper,
                      uint32_t random_key, uint32_t first_index, int max_blocks) {
  GX_CHECK(param.device().is_cuda(), "device_adam_step: expected CUDA tensors, got param on ", param.device().str(),
           ". Host tensors step with cpu_adam_step.");
  const at::ScalarType state = exp_avg.scalar_type();
  const bool bf16_param = param.scalar_type() == at::kBFloat16;
  GX_CHECK(param.scalar_type() == at::kFloat || (bf16_param && state == at::kBFloat16 && !param16.has_value()),
           "device_adam_step: param (the master) must be float32, or bfloat16 with bfloat16 moments and no param16 "
           "(the 8-byte state), got ", c10::toString(param.scalar_type()), " with ", c10::toString(state),
           " moments", param16.has_value() ? " and a param16" : "", ".");
  GX_CHECK(exp_avg_sq.scalar_type() == state && (state == at::kFloat || state == at::kBFloat16),
           "device_adam_step: exp_avg and exp_avg_sq must both be float32 or both bfloat16, got ",
           c10::toString(state), " and ", c10::toString(exp_avg_sq.scalar_type()), ".");
  const at::ScalarType g = grad.scalar_type();
  GX_CHECK(g == at::kFloat || g == at::kBFloat16 || g == at::kHalf,
           "device_adam_step: grad must be float32, bfloat16 or float16, got ", c10::toString(g), ".");
  check_device_tensor(param, "param", param);
  check_device_tensor(exp_avg, "exp_avg", param);
  check_device_tensor(exp_avg_sq, "exp_avg_sq", param);
  check_device_tensor(grad, "grad", param);
  if (param16.has_value()) {
    check_device_tensor(*param16, "param16", param);
    const at::ScalarType t = param16->scalar_type();
    GX_CHECK(t == at::kBFloat16 || t == at::kHalf, "device_adam_step: param16 must be bfloat16 or float16, got ",
             c10::toString(t), ".");
  }
  check_adam_hyper(hyper);
#ifdef GX_WITH_CUDA
  DeviceAdamBuffers b;
  b.param = param.data_ptr();
  b.master_dtype = to_gx_dtype(param.scalar_type());
  b.exp_avg = exp_avg.data_ptr();
  b.exp_avg_sq = exp_avg_sq.data_ptr();
  b.state_dtype = to_gx_dtype(state);
  b.grad = grad.data_ptr();
  b.grad_dtype = to_gx_dtype(g);
  if (param16.has_value()) {
    b.param16 = param16->data_ptr();
    b.param16_dtype = to_gx_dtype(param16->scalar_type());
  }
  b.numel = param.numel();
  b.random_key = random_key;
  b.first_index = first_index;
  b.max_blocks = max_blocks;
  const c10::cuda::CUDAGuard guard(param.device());
  adam_step_on_device(adam_constants(hyper), b, c10::cuda::getCurrentCUDAStream(param.device().index()).stream());
#else
  GX_CHECK(false, "device_adam_step: this build of gemini_ext has no CUDA support; rebuild it against a CUDA "
           "build of torch with nvcc on PATH (see README).");
#endif
}

}  // namespace gx::torch_layer
