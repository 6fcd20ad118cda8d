#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/kernels/cpu_adam.h"
#include "core/kernels/cpu_adam_bf16_moments.h"
#include "core/errors.h"
#include "core/kernels/half_convert.h"
#include "core/kernels/stochastic_round.h"
#include "simd_isas.h"

namespace gx {
namespace {

struct Data {
  std::vector<float> p;
  std::vector<uint16_t> m, v, g;
};

Data random_data(int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Data d{std::vector<float>(n), std::vector<uint16_t>(n), std::vector<uint16_t>(n), std::vector<uint16_t>(n)};
  for (int64_t i = 0; i < n; ++i) {
    d.p[i] = normal(rng);
    d.m[i] = float_to_bf16(normal(rng) * 0.01f);
    d.v[i] = float_to_bf16(std::abs(normal(rng)) * 1e-4f);
    d.g[i] = float_to_bf16(normal(rng) * 0.1f);
  }
  return d;
}

AdamHyper hyper() {
  AdamHyper h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  h.step = 4;
  h.grad_scale = 0.5;
  return h;
}

// The kernel's contract: the fp32 update of the widened moments, then stochastic rounding with
// the bits of (key, first_index + i): their low half for m, their high half for v.
TEST(CpuAdamBf16Moments, EqualsTheFp32UpdateOfTheWidenedMomentsThenStochasticRounding) {
  const int64_t n = 3 * kBf16MomentsBlockNumel + 37;  // a partial block at the end
  const uint32_t key = stochastic_key(7, 1234), first = 5000;
  const Data d = random_data(n, 3);
  std::vector<float> p_ref = d.p, m_ref(n), v_ref(n);
  for (int64_t i = 0; i < n; ++i) {
    m_ref[i] = bf16_to_float(d.m[i]);
    v_ref[i] = bf16_to_float(d.v[i]);
  }
  std::vector<uint16_t> p16_ref(n);
  AdamBuffers ref{p_ref.data(), m_ref.data(), v_ref.data(), d.g.data(), DType::kBFloat16, p16_ref.data(),
                  DType::kBFloat16, n};
  cpu_adam_step(hyper(), ref, SimdIsa::kScalar);
  for (SimdIsa isa : available_isas()) {
    Data x = d;
    std::vector<uint16_t> p16(n);
    AdamBuffers b;
    b.param = x.p.data();
    b.grad = x.g.data();
    b.grad_dtype = DType::kBFloat16;
    b.param16 = p16.data();
    b.numel = n;
    Bf16Moments mom;
    mom.exp_avg = x.m.data();
    mom.exp_avg_sq = x.v.data();
    mom.key = key;
    mom.first_index = first;
    cpu_adam_step_bf16_moments(hyper(), b, mom, isa);
    ASSERT_EQ(x.p, p_ref) << to_string(isa) << ": the fp32 master is the fp32 kernel's, bit for bit";
    ASSERT_EQ(p16, p16_ref) << to_string(isa);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = stochastic_bits(key, first + static_cast<uint32_t>(i));
      ASSERT_EQ(x.m[i], float_to_bf16_stochastic(m_ref[i], bits)) << to_string(isa) << " " << i;
      ASSERT_EQ(x.v[i], float_to_bf16_stochastic(v_ref[i], bits >> 16)) << to_string(isa) << " " << i;
    }
  }
}

TEST(CpuAdamBf16Moments, OutOfPlaceWritesTheInPlaceResultAndLeavesTheInputs) {
  const int64_t n = kBf16MomentsBlockNumel + 5;
  const Data d = random_data(n, 9);
  Data in_place = d;
  AdamBuffers b;
  b.grad = d.g.data();
  b.grad_dtype = DType::kBFloat16;
  b.numel = n;
  b.param = in_place.p.data();
  Bf16Moments mom;
  mom.exp_avg = in_place.m.data();
  mom.exp_avg_sq = in_place.v.data();
  mom.key = 7;
  cpu_adam_step_bf16_moments(hyper(), b, mom);
  Data inputs = d;
  std::vector<float> p_out(n);
  std::vector<uint16_t> m_out(n), v_out(n);
  b.param = inputs.p.data();
  b.param_out = p_out.data();
  mom.exp_avg = inputs.m.data();
  mom.exp_avg_sq = inputs.v.data();
  mom.exp_avg_out = m_out.data();
  mom.exp_avg_sq_out = v_out.data();
  cpu_adam_step_bf16_moments(hyper(), b, mom);
  EXPECT_EQ(p_out, in_place.p);
  EXPECT_EQ(m_out, in_place.m);
  EXPECT_EQ(v_out, in_place.v);
  EXPECT_EQ(inputs.p, d.p);
  EXPECT_EQ(inputs.m, d.m);
  EXPECT_EQ(inputs.v, d.v);
}

// Why the rounding is stochastic: with beta1 = 0.999, m moves toward a gradient one bf16 step
// (2^-7) above it by 2^-7 / 1000 a step, far below half a step. Rounded to nearest it would never
// leave 1.0; stochastically rounded, its mean over elements follows the fp32 recurrence.
TEST(CpuAdamBf16Moments, SmallIncrementsSurviveOnAverage) {
  const int64_t n = 32768;
  std::vector<float> p(n, 0.0f);
  std::vector<uint16_t> m(n, float_to_bf16(1.0f)), v(n, float_to_bf16(1.0f)), g(n, float_to_bf16(1.0078125f));
  const double g_value = 1.0078125;  // 1 + 2^-7: one bf16 step above 1
  double m_fp32 = 1.0;
  AdamHyper h;
  h.lr = 0.0;
  h.beta1 = 0.999;
  AdamBuffers b;
  b.param = p.data();
  b.grad = g.data();
  b.grad_dtype = DType::kBFloat16;
  b.numel = n;
  Bf16Moments mom;
  mom.exp_avg = m.data();
  mom.exp_avg_sq = v.data();
  for (int64_t t = 1; t <= 500; ++t) {
    h.step = t;
    mom.key = stochastic_key(t, 0);
    cpu_adam_step_bf16_moments(h, b, mom);
    m_fp32 += (1.0 - h.beta1) * (g_value - m_fp32);
  }
  double mean = 0.0;
  for (uint16_t x : m) mean += bf16_to_float(x);
  mean /= n;
  EXPECT_GT(m_fp32 - 1.0, 0.003) << "the fp32 recurrence moved";
  EXPECT_NEAR(mean, m_fp32, 0.05 * (m_fp32 - 1.0)) << "the bf16 moments followed it on average";
}

// A bf16 master: the fp32 update of the widened parameter and moments, then each rounded
// stochastically, the parameter from its own stream; the same bits on every ISA, in place or out.
TEST(CpuAdamBf16Moments, Bf16MasterEqualsTheWidenedUpdateThenStochasticRounding) {
  const int64_t n = 2 * kBf16MomentsBlockNumel + 45;
  const uint32_t key = stochastic_key(3, 77), first = 123;
  const Data d = random_data(n, 11);
  std::vector<uint16_t> p16_in(n);
  for (int64_t i = 0; i < n; ++i) p16_in[i] = float_to_bf16(d.p[i]);
  std::vector<float> p_ref(n), m_ref(n), v_ref(n);
  for (int64_t i = 0; i < n; ++i) {
    p_ref[i] = bf16_to_float(p16_in[i]);
    m_ref[i] = bf16_to_float(d.m[i]);
    v_ref[i] = bf16_to_float(d.v[i]);
  }
  AdamBuffers ref{p_ref.data(), m_ref.data(), v_ref.data(), d.g.data(), DType::kBFloat16, nullptr,
                  DType::kBFloat16, n};
  cpu_adam_step(hyper(), ref, SimdIsa::kScalar);
  std::vector<uint16_t> p_want(n);
  const uint32_t param_key = param_stream_key(key);
  int64_t moved = 0;
  for (int64_t i = 0; i < n; ++i) {
    p_want[i] = float_to_bf16_stochastic(p_ref[i], stochastic_bits(param_key, first + static_cast<uint32_t>(i)));
    moved += p_want[i] != p16_in[i];
  }
  EXPECT_GT(moved, n / 2) << "the update moves most bf16 parameters";
  for (SimdIsa isa : available_isas()) {
    for (bool out_of_place : {false, true}) {
      std::vector<uint16_t> p16 = p16_in, m = d.m, v = d.v, p_out(n), m_out(n), v_out(n);
      AdamBuffers b;
      b.grad = d.g.data();
      b.grad_dtype = DType::kBFloat16;
      b.numel = n;
      Bf16Moments mom;
      mom.param = p16.data();
      mom.exp_avg = m.data();
      mom.exp_avg_sq = v.data();
      if (out_of_place) {
        mom.param_out = p_out.data();
        mom.exp_avg_out = m_out.data();
        mom.exp_avg_sq_out = v_out.data();
      }
      mom.key = key;
      mom.first_index = first;
      cpu_adam_step_bf16_moments(hyper(), b, mom, isa);
      const std::string where = std::string(to_string(isa)) + (out_of_place ? " out of place" : " in place");
      ASSERT_EQ(out_of_place ? p_out : p16, p_want) << where;
      const std::vector<uint16_t>& m_new = out_of_place ? m_out : m;
      const std::vector<uint16_t>& v_new = out_of_place ? v_out : v;
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t bits = stochastic_bits(key, first + static_cast<uint32_t>(i));
        ASSERT_EQ(m_new[i], float_to_bf16_stochastic(m_ref[i], bits)) << where << " " << i;
        ASSERT_EQ(v_new[i], float_to_bf16_stochastic(v_ref[i], bits >> 16)) << where << " " << i;
      }
      if (out_of_place) {
        EXPECT_EQ(p16, p16_in) << where << ": the inputs stay";
        EXPECT_EQ(m, d.m) << where;
      }
    }
  }
}

TEST(CpuAdamBf16Moments, Bf16MasterRefusesAnFp32MasterOrCopyBesideIt) {
  std::vector<float> p(4);
  std::vector<uint16_t> p16(4), m(4), v(4), g(4), copy(4);
  AdamBuffers b;
  b.grad = g.data();
  b.grad_dtype = DType::kBFloat16;
  b.numel = 4;
  Bf16Moments mom;
  mom.param = p16.data();
  mom.exp_avg = m.data();
  mom.exp_avg_sq = v.data();
  b.param = p.data();  // two masters
  EXPECT_THROW(cpu_adam_step_bf16_moments(hyper(), b, mom), UsageError);
  b.param = nullptr;
  b.param16 = copy.data();  // a 16-bit copy of a parameter that is itself 16-bit
  EXPECT_THROW(cpu_adam_step_bf16_moments(hyper(), b, mom), UsageError);
  b.param16 = nullptr;
  mom.param_out = copy.data();  // out of place for the parameter only
  EXPECT_THROW(cpu_adam_step_bf16_moments(hyper(), b, mom), UsageError);
  mom.param_out = nullptr;
  EXPECT_NO_THROW(cpu_adam_step_bf16_moments(hyper(), b, mom));
}

TEST(CpuAdamBf16Moments, RefusesMismatchedBuffers) {
  std::vector<float> p(4);
  std::vector<uint16_t> m(4), v(4), g(4), out(4);
  AdamBuffers b;
  b.param = p.data();
  b.grad = g.data();
  b.grad_dtype = DType::kBFloat16;
  b.numel = 4;
  Bf16Moments mom;
  mom.exp_avg = m.data();
  mom.exp_avg_sq = v.data();
  mom.exp_avg_out = out.data();  // out of place without param_out
  EXPECT_THROW(cpu_adam_step_bf16_moments(hyper(), b, mom), UsageError);
  mom.exp_avg_out = nullptr;
  b.exp_avg = p.data();  // fp32 moments as well
  EXPECT_THROW(cpu_adam_step_bf16_moments(hyper(), b, mom), UsageError);
}

}  // namespace
}  // namespace gx
