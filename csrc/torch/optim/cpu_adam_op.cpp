#include "torch/optim/cpu_adam_op.h"

#include <cstdint>

#include "core/kernels/cpu_adam.h"
#include "core/errors.h"
#include "torch/optim/cpu_kernel_args.h"
#include "torch/dtype_map.h"

namespace gx::torch_layer {

AdamHyper adam_hyper_of(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                         bool adamw, double grad_scale) {
  AdamHyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.decoupled_weight_decay = adamw;
  h.step = step;
  h.grad_scale = grad_scale;
  return h;
}

CpuAdamWork prepare_cpu_adam(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                             const at::Tensor& grad, const std::optional<at::Tensor>& param16, const AdamHyper& hyper,
                             uint32_t random_key, uint32_t first_index) {
  const int64_t n = param.numel();
  const bool bf16_moments = exp_avg.scalar_type() == at::kBFloat16;
  const bool bf16_param = param.scalar_type() == at::kBFloat16;
  GX_CHECK(param.scalar_type() == at::kFloat || (bf16_param && bf16_moments && !param16.has_value()),
           "cpu_adam_step: param (the master) must be float32, or bfloat16 with bfloat16 moments and no param16 "
           "(the 8-byte state), got ", c10::toString(param.scalar_type()), " with ",
           c10::toString(exp_avg.scalar_type()), " moments", param16.has_value() ? " and a param16" : "", ".");
  GX_CHECK(exp_avg.scalar_type() == exp_avg_sq.scalar_type() && (bf16_moments || exp_avg.scalar_type() == at::kFloat),
           "cpu_adam_step: exp_avg and exp_avg_sq must both be float32 or both bfloat16, got ",
           c10::toString(exp_avg.scalar_type()), " and ", c10::toString(exp_avg_sq.scalar_type()), ".");
  check_cpu_tensor(param, "cpu_adam_step", "param", n);
  check_cpu_tensor(exp_avg, "cpu_adam_step", "exp_avg", n);
  check_cpu_tensor(exp_avg_sq, "cpu_adam_step", "exp_avg_sq", n);
  check_cpu_tensor(grad, "cpu_adam_step", "grad", n);
  AdamBuffers b;
  std::optional<Bf16Moments> moments;
  if (!bf16_param) b.param = param.data_ptr<float>();
  if (bf16_moments) {
    moments.emplace();
    if (bf16_param) moments->param = static_cast<uint16_t*>(param.data_ptr());
    moments->exp_avg = static_cast<uint16_t*>(exp_avg.data_ptr());
    moments->exp_avg_sq = static_cast<uint16_t*>(exp_avg_sq.data_ptr());
    moments->key = random_key;
    moments->first_index = first_index;
  } else {
    b.exp_avg = exp_avg.data_ptr<float>();
    b.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  }
  b.grad = grad.data_ptr();
  b.grad_dtype = to_gx_dtype(grad.scalar_type());
  b.numel = n;
  if (param16.has_value()) {
    check_cpu_tensor(*param16, "cpu_adam_step", "param16", n);
    b.param16 = param16->data_ptr();
    b.param16_dtype = to_gx_dtype(param16->scalar_type());
  }
  CpuAdamWork work{hyper, b, moments};
  work.check();
  return work;
}

void CpuAdamWork::check() const {
  if (moments.has_value()) {
    check_adam_bf16_moments_args(hyper, buffers, *moments);
  } else {
    check_adam_args(hyper, buffers);
  }
}

void CpuAdamWork::run(SimdIsa isa) const {
  if (moments.has_value()) {
    gx::cpu_adam_step_bf16_moments(hyper, buffers, *moments, isa);
  } else {
    gx::cpu_adam_step(hyper, buffers, isa);
  }
}

void cpu_adam_step(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                   const at::Tensor& grad, const std::optional<at::Tensor>& param16, int64_t step, double lr,
                   double beta1, double beta2, double eps, double weight_decay, bool adamw, double grad_scale,
                   const std::string& isa, const std::optional<std::vector<at::Tensor>>& out, int64_t random_key,
                   int64_t first_index) {
  const SimdIsa simd = parse_simd_isa(isa, "cpu_adam_step");
  GX_CHECK(random_key >= 0 && random_key <= UINT32_MAX && first_index >= 0 && first_index <= UINT32_MAX,
           "cpu_adam_step: random_key and first_index must be in [0, 2^32), got ", random_key, " and ",
           first_index, ".");
  CpuAdamWork w = prepare_cpu_adam(param, exp_avg, exp_avg_sq, grad, param16,
                                   adam_hyper_of(step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale),
                                   static_cast<uint32_t>(random_key), static_cast<uint32_t>(first_index));
  if (out.has_value()) {
    GX_CHECK(out->size() == 3, "cpu_adam_step out: expected (param_out, exp_avg_out, exp_avg_sq_out), got ",
             out->size(), " tensors.");
    const char* names[] = {"param_out", "exp_avg_out", "exp_avg_sq_out"};
    for (size_t k = 0; k < 3; ++k) {
      const at::ScalarType want = k == 0 ? param.scalar_type() : exp_avg.scalar_type();
      GX_CHECK((*out)[k].scalar_type() == want, "cpu_adam_step: ", names[k], " must be ", c10::toString(want),
               ", got ", c10::toString((*out)[k].scalar_type()), ".");
      check_cpu_tensor((*out)[k], "cpu_adam_step", names[k], param.numel());
    }
    if (w.moments.has_value() && w.moments->param != nullptr) {
      w.moments->param_out = static_cast<uint16_t*>((*out)[0].data_ptr());
    } else {
      w.buffers.param_out = (*out)[0].data_ptr<float>();
    }
    if (w.moments.has_value()) {
      w.moments->exp_avg_out = static_cast<uint16_t*>((*out)[1].data_ptr());
      w.moments->exp_avg_sq_out = static_cast<uint16_t*>((*out)[2].data_ptr());
    } else {
      w.buffers.exp_avg_out = (*out)[1].data_ptr<float>();
      w.buffers.exp_avg_sq_out = (*out)[2].data_ptr<float>();
    }
    w.check();
  }
  w.run(simd);
}

}  // namespace gx::torch_layer
