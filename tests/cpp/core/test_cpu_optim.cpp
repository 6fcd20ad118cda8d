// CPU SGD, Lion and Adagrad (core/kernels/cpu_optim.h): every ISA path against a double-precision
// reference, bit-identical to each other, out of place equal to in place.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/kernels/cpu_optim.h"
#include "core/errors.h"
#include "core/kernels/half_convert.h"
#include "simd_isas.h"

namespace gx {
namespace {

// The published update rules in double precision, one element at a time.
struct OptimRef {
  double p, s;  // parameter, the one state (momentum buffer, exp_avg or sum)
  void step(double g, const CpuOptimHyper& h) {
    g *= h.grad_scale;
    if (h.maximize) g = -g;
    switch (h.kind) {
      case CpuOptimizer::kSgd:
        g += h.weight_decay * p;
        if (h.momentum != 0) {
          s = h.step == 1 ? g : h.momentum * s + (1 - h.dampening) * g;
          g = h.nesterov ? g + h.momentum * s : s;
        }
        p -= h.lr * g;
        break;
      case CpuOptimizer::kLion: {
        const double c = h.beta1 * s + (1 - h.beta1) * g;
        p = p * (1 - h.lr * h.weight_decay) - h.lr * ((c > 0) - (c < 0));
        s = h.beta2 * s + (1 - h.beta2) * g;
        break;
      }
      case CpuOptimizer::kAdagrad: {
        g += h.weight_decay * p;
        s = (h.step == 1 ? h.initial_accumulator_value : s) + g * g;
        p -= h.lr / (1 + (h.step - 1) * h.lr_decay) * g / (std::sqrt(s) + h.eps);
        break;
      }
    }
  }
};

struct OptimCase {
  CpuOptimHyper hyper;
  DType grad_dtype;
  int64_t numel;
};

CpuOptimHyper sgd(double momentum, double dampening, bool nesterov, double wd, bool maximize) {
  CpuOptimHyper h;
  h.kind = CpuOptimizer::kSgd;
  h.lr = 1e-2;
  h.momentum = momentum;
  h.dampening = dampening;
  h.nesterov = nesterov;
  h.weight_decay = wd;
  h.maximize = maximize;
  return h;
}

CpuOptimHyper lion(double wd) {
  CpuOptimHyper h;
  h.kind = CpuOptimizer::kLion;
  h.lr = 1e-3;
  h.weight_decay = wd;
  return h;
}

CpuOptimHyper adagrad(double lr_decay, double wd, double initial, bool maximize) {
  CpuOptimHyper h;
  h.kind = CpuOptimizer::kAdagrad;
  h.lr = 1e-2;
  h.lr_decay = lr_decay;
  h.weight_decay = wd;
  h.initial_accumulator_value = initial;
  h.maximize = maximize;
  return h;
}

class CpuOptim : public ::testing::TestWithParam<OptimCase> {};

TEST_P(CpuOptim, EveryIsaMatchesTheDoubleReferenceAndEachOther) {
  const OptimCase k = GetParam();
  const int64_t n = k.numel;
  std::mt19937 rng(static_cast<unsigned>(n));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p0(n);
  std::vector<std::vector<float>> g32(5, std::vector<float>(n));
  std::vector<std::vector<uint16_t>> g16(5, std::vector<uint16_t>(n));
  for (int64_t i = 0; i < n; ++i) p0[i] = normal(rng);
  for (int t = 0; t < 5; ++t) {
    for (int64_t i = 0; i < n; ++i) {
      float g = normal(rng) * 0.1f;
      if (k.grad_dtype == DType::kBFloat16) {
        g16[t][i] = float_to_bf16(g);
        g = bf16_to_float(g16[t][i]);
      } else if (k.grad_dtype == DType::kFloat16) {
        g16[t][i] = float_to_fp16(g);
        g = fp16_to_float(g16[t][i]);
      }
      g32[t][i] = g;
    }
  }
  std::vector<std::vector<float>> params, states;
  std::vector<std::vector<uint16_t>> copies;
  for (SimdIsa isa : available_isas()) {
    std::vector<float> p = p0, s(n, 0.0f);
    std::vector<uint16_t> out(n, 0);
    std::vector<OptimRef> ref(n);
    for (int64_t i = 0; i < n; ++i) ref[i] = OptimRef{p0[i], 0.0};
    CpuOptimHyper h = k.hyper;
    h.grad_scale = 0.5;
    for (int64_t t = 1; t <= 5; ++t) {
      h.step = t;
      CpuOptimBuffers b;
      b.param = p.data();
      b.state[0] = s.data();
      b.grad = k.grad_dtype == DType::kFloat32 ? static_cast<const void*>(g32[t - 1].data()) : g16[t - 1].data();
      b.grad_dtype = k.grad_dtype;
      b.param16 = out.data();
      b.param16_dtype = DType::kFloat16;
      b.numel = n;
      cpu_optim_step(h, b, isa);
      for (int64_t i = 0; i < n; ++i) ref[i].step(g32[t - 1][i], h);
    }
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(p[i], ref[i].p, 1e-5 * std::max(1.0, std::abs(ref[i].p))) << to_string(isa) << " i=" << i;
      if (num_states(h.kind, h.momentum != 0) > 0) {
        ASSERT_NEAR(s[i], ref[i].s, 1e-5 * std::max(1e-2, std::abs(ref[i].s))) << to_string(isa) << " i=" << i;
      }
      ASSERT_EQ(out[i], float_to_fp16(p[i])) << "fp16 copy of the updated param, " << to_string(isa);
    }
    params.push_back(p);
    states.push_back(s);
    copies.push_back(out);
  }
  for (size_t r = 1; r < params.size(); ++r) {
    EXPECT_EQ(params[r], params[0]) << "every ISA path gives bit-identical params";
    EXPECT_EQ(states[r], states[0]);
    EXPECT_EQ(copies[r], copies[0]);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Grid, CpuOptim,
    ::testing::Values(OptimCase{sgd(0.0, 0.0, false, 0.0, false), DType::kFloat32, 1},
                      OptimCase{sgd(0.9, 0.0, false, 0.01, false), DType::kBFloat16, 4099},
                      OptimCase{sgd(0.9, 0.0, true, 0.0, true), DType::kFloat32, 1000},
                      OptimCase{sgd(0.5, 0.3, false, 0.1, false), DType::kFloat16, 200003},
                      OptimCase{lion(0.0), DType::kFloat32, 17}, OptimCase{lion(0.1), DType::kBFloat16, 100003},
                      OptimCase{lion(1.0), DType::kFloat16, 31},
                      OptimCase{adagrad(0.0, 0.0, 0.0, false), DType::kFloat32, 1000},
                      OptimCase{adagrad(0.01, 0.1, 0.1, false), DType::kBFloat16, 4101},
                      OptimCase{adagrad(0.0, 0.0, 0.5, true), DType::kFloat16, 200003}));

TEST(CpuOptim, OutOfPlaceWritesTheInPlaceResultAndLeavesTheInputs) {
  const int64_t n = 1037;  // not a multiple of any vector width: the scalar tail runs too
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p0(n), s0(n), g(n);
  for (int64_t i = 0; i < n; ++i) {
    p0[i] = normal(rng);
    s0[i] = std::abs(normal(rng)) * 0.01f;
    g[i] = normal(rng) * 0.1f;
  }
  for (CpuOptimHyper h : {sgd(0.9, 0.1, false, 0.1, false), lion(0.1), adagrad(0.1, 0.1, 0.0, false)}) {
    h.step = 3;
    for (SimdIsa isa : available_isas()) {
      std::vector<float> p = p0, s = s0;
      std::vector<uint16_t> in_place16(n), out16(n);
      CpuOptimBuffers in_place;
      in_place.param = p.data();
      in_place.state[0] = s.data();
      in_place.grad = g.data();
      in_place.param16 = in_place16.data();
      in_place.numel = n;
      cpu_optim_step(h, in_place, isa);
      std::vector<float> pi = p0, si = s0, po(n), so(n);
      CpuOptimBuffers out = in_place;
      out.param = pi.data();
      out.state[0] = si.data();
      out.param16 = out16.data();
      out.param_out = po.data();
      out.state_out[0] = so.data();
      cpu_optim_step(h, out, isa);
      EXPECT_EQ(po, p) << to_string(h.kind) << " " << to_string(isa);
      EXPECT_EQ(so, s) << to_string(h.kind) << " " << to_string(isa);
      EXPECT_EQ(out16, in_place16);
      EXPECT_EQ(pi, p0) << "the inputs are untouched";
      EXPECT_EQ(si, s0);
    }
  }
}

TEST(CpuOptimArgs, BadHyperparametersAreUsageErrors) {
  float x = 0;
  CpuOptimBuffers b;
  b.param = &x;
  b.state[0] = &x;
  b.grad = &x;
  b.numel = 1;
  CpuOptimHyper h = sgd(0.9, 0.1, true, 0.0, false);  // nesterov with dampening
  EXPECT_THROW(cpu_optim_step(h, b), UsageError);
  h = lion(0.0);
  h.beta2 = 1.5;
  EXPECT_THROW(cpu_optim_step(h, b), UsageError);
  h = adagrad(-1.0, 0.0, 0.0, false);
  EXPECT_THROW(cpu_optim_step(h, b), UsageError);
  h = sgd(0.9, 0.0, false, 0.0, false);
  b.state[0] = nullptr;  // momentum needs its buffer
  EXPECT_THROW(cpu_optim_step(h, b), UsageError);
  h.momentum = 0.0;  // plain SGD has no state
  float y = 1.0f;
  b.grad = &y;
  cpu_optim_step(h, b);
  EXPECT_FLOAT_EQ(x, -h.lr);
}

}  // namespace
}  // namespace gx
