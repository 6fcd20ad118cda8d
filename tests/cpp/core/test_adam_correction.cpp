// The correction and the undo of an in-place speculative Adam step (core/kernels/adam_correction.h)
// against the serial step, on every ISA.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/errors.h"
#include "core/kernels/adam_correction.h"
#include "core/kernels/half_convert.h"
#include "simd_isas.h"

namespace gx {
namespace {

struct State {
  std::vector<float> p, m, v;
  std::vector<uint16_t> p16;
  AdamBuffers buffers(const std::vector<uint16_t>& grad) {
    AdamBuffers b;
    b.param = p.data();
    b.exp_avg = m.data();
    b.exp_avg_sq = v.data();
    b.grad = grad.data();
    b.grad_dtype = DType::kBFloat16;
    b.param16 = p16.data();
    b.numel = static_cast<int64_t>(p.size());
    return b;
  }
};

// Moments as training leaves them (v the running mean square of gradients of about 1e-3, m their
// running mean), and a bf16 gradient of up to 4 times that scale. `fresh`: before the first step.
State warm_state(int64_t n, std::vector<uint16_t>& grad, unsigned seed, bool fresh = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  State s{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n), std::vector<uint16_t>(n)};
  grad.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const float scale = 1e-3f * (1.0f + static_cast<float>(i % 5));
    s.p[i] = normal(rng) * 0.05f;
    const bool never_stepped = fresh || i % 11 == 0;  // an embedding row's first gradient, say
    s.m[i] = never_stepped ? 0.0f : normal(rng) * scale * 0.3f;
    s.v[i] = never_stepped ? 0.0f : scale * scale * (0.5f + std::fabs(normal(rng)));
    grad[i] = float_to_bf16(normal(rng) * scale * (i % 7 == 0 ? 4.0f : 1.0f));
  }
  return s;
}

AdamHyper hyper_of(bool adamw, double wd, int64_t step, double multiplier) {
  AdamHyper h;
  h.lr = 1e-3;
  h.weight_decay = wd;
  h.decoupled_weight_decay = adamw;
  h.step = step;
  h.grad_scale = multiplier;
  return h;
}

// |a - b| <= rel |b| + abs, element by element, with the worst index in the message.
void expect_close(const std::vector<float>& a, const std::vector<float>& b, double rel, double abs, const char* what) {
  double worst = 0.0;
  size_t at = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double excess = std::fabs(double(a[i]) - b[i]) - (rel * std::fabs(double(b[i])) + abs);
    if (excess > worst) worst = excess, at = i;
  }
  EXPECT_EQ(worst, 0.0) << what << "[" << at << "]: " << a[at] << " vs " << b[at];
}

class AdamCorrection : public ::testing::TestWithParam<std::tuple<bool, double>> {};

TEST_P(AdamCorrection, CorrectedStepIsTheSerialStepWithinAFewUlps) {
  const auto [adamw, wd] = GetParam();
  for (double c : {0.9, 0.3, 0.01, 0.0}) {
    std::vector<uint16_t> grad;
    State serial = warm_state(1003, grad, 7);
    State spec = serial;
    const State start = serial;
    cpu_adam_step(hyper_of(adamw, wd, 5, c), serial.buffers(grad));
    cpu_adam_step(hyper_of(adamw, wd, 5, 1.0), spec.buffers(grad));
    const State speculated = spec;
    adam_correct_step(hyper_of(adamw, wd, 5, 1.0), c, spec.buffers(grad));
    // Parameters: 4 ulps of the serial value (relative 1e-6 with a floor of 1e-10 near zero).
    expect_close(spec.p, serial.p, 1e-6, 1e-10, "p");
    // Moments: the rounding of m' and v' stays (adam_correction.h's Note): half an ulp of the
    // speculated moment, relative to the larger of the two.
    // Moments: an absolute error of a few (at most 8) ulps of the largest value involved (the rounding of the
    // speculated m' and v', which the correction cannot recover, and the serial step's own).
    auto ulps_of_largest = [](float a, float b, float c) {
      return 0x1p-21 * std::max({std::fabs(a), std::fabs(b), std::fabs(c)});
    };
    for (size_t i = 0; i < spec.m.size(); ++i) {
      if (start.m[i] == 0.0f && start.v[i] == 0.0f && (adamw || wd == 0.0)) {  // were zero: the serial bits
        ASSERT_EQ(spec.m[i], serial.m[i]) << "m " << i << " c " << c;
        ASSERT_EQ(spec.v[i], serial.v[i]) << "v " << i << " c " << c;
      }
      ASSERT_LE(std::fabs(double(spec.m[i]) - serial.m[i]), ulps_of_largest(speculated.m[i], start.m[i], serial.m[i]))
          << "m " << i;
      ASSERT_LE(std::fabs(double(spec.v[i]) - serial.v[i]), ulps_of_largest(speculated.v[i], start.v[i], serial.v[i]))
          << "v " << i;
    }
    for (size_t i = 0; i < spec.p.size(); ++i) ASSERT_EQ(spec.p16[i], float_to_bf16(spec.p[i])) << i;
  }
}

TEST_P(AdamCorrection, FirstStepMomentsAreTheSerialStepsBits) {
  const auto [adamw, wd] = GetParam();
  for (double c : {0.5, 0.01}) {
    std::vector<uint16_t> grad;
    State serial = warm_state(1003, grad, 5, /*fresh=*/true);
    State spec = serial;
    cpu_adam_step(hyper_of(adamw, wd, 1, c), serial.buffers(grad));
    cpu_adam_step(hyper_of(adamw, wd, 1, 1.0), spec.buffers(grad));
    adam_correct_step(hyper_of(adamw, wd, 1, 1.0), c, spec.buffers(grad));
    expect_close(spec.p, serial.p, 1e-6, 1e-10, "p");
    if (adamw || wd == 0.0) {  // Adam's L2 term reads the reconstructed parameter
      EXPECT_EQ(spec.m, serial.m);
      EXPECT_EQ(spec.v, serial.v);
    }
    State undone = serial;  // the undo of a first step restores zeros exactly
    adam_undo_step(hyper_of(adamw, wd, 1, c), undone.buffers(grad));
    EXPECT_EQ(undone.m, std::vector<float>(undone.m.size(), 0.0f));
    EXPECT_EQ(undone.v, std::vector<float>(undone.v.size(), 0.0f));
  }
}

TEST_P(AdamCorrection, UndoRestoresTheStateBeforeTheStep) {
  const auto [adamw, wd] = GetParam();
  std::vector<uint16_t> grad;
  const State before = warm_state(1003, grad, 11);
  State s = before;
  cpu_adam_step(hyper_of(adamw, wd, 3, 1.0), s.buffers(grad));
  adam_undo_step(hyper_of(adamw, wd, 3, 1.0), s.buffers(grad));
  expect_close(s.p, before.p, 1e-6, 1e-10, "p");
  expect_close(s.m, before.m, 1e-6, 1e-10, "m");
  expect_close(s.v, before.v, 1e-6, 1e-15, "v");
  for (size_t i = 0; i < s.m.size(); i += 11) {  // were zero: zeros again
    if (!adamw && wd != 0.0) break;  // Adam's L2 term reads the restored parameter
    ASSERT_EQ(s.m[i], 0.0f) << i;
    ASSERT_EQ(s.v[i], 0.0f) << i;
  }
  // Stepping again from the restored state gives the serial step with another multiplier.
  State serial = before;
  cpu_adam_step(hyper_of(adamw, wd, 3, 0.5), serial.buffers(grad));
  cpu_adam_step(hyper_of(adamw, wd, 3, 0.5), s.buffers(grad));
  expect_close(s.p, serial.p, 1e-6, 1e-10, "p after the redo");
}

TEST_P(AdamCorrection, EveryIsaGivesTheSameBits) {
  const auto [adamw, wd] = GetParam();
  std::vector<uint16_t> grad;
  const State start = warm_state(1000 + 37, grad, 3);
  std::vector<State> corrected, undone;
  for (SimdIsa isa : available_isas()) {
    State a = start, b = start;
    adam_correct_step(hyper_of(adamw, wd, 9, 1.0), 0.25, a.buffers(grad), isa);
    adam_undo_step(hyper_of(adamw, wd, 9, 1.0), b.buffers(grad), isa);
    corrected.push_back(a);
    undone.push_back(b);
  }
  for (size_t k = 1; k < corrected.size(); ++k) {
    EXPECT_EQ(corrected[k].p, corrected[0].p);
    EXPECT_EQ(corrected[k].m, corrected[0].m);
    EXPECT_EQ(corrected[k].v, corrected[0].v);
    EXPECT_EQ(corrected[k].p16, corrected[0].p16);
    EXPECT_EQ(undone[k].p, undone[0].p);
    EXPECT_EQ(undone[k].m, undone[0].m);
    EXPECT_EQ(undone[k].v, undone[0].v);
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, AdamCorrection,
                         ::testing::Values(std::make_tuple(true, 0.0), std::make_tuple(true, 0.1),
                                           std::make_tuple(false, 0.0), std::make_tuple(false, 0.01)));

TEST(AdamCorrectionArgs, RefusesOutOfPlaceBuffersAndNonFiniteMultipliers) {
  std::vector<uint16_t> grad;
  State s = warm_state(64, grad, 1);
  std::vector<float> out(64);
  AdamBuffers b = s.buffers(grad);
  EXPECT_THROW(adam_correct_step(hyper_of(true, 0.0, 1, 1.0), std::nan(""), b), UsageError);
  b.param_out = b.exp_avg_out = b.exp_avg_sq_out = out.data();
  EXPECT_THROW(adam_correct_step(hyper_of(true, 0.0, 1, 1.0), 0.5, b), UsageError);
  EXPECT_THROW(adam_undo_step(hyper_of(true, 0.0, 1, 1.0), b), UsageError);
}

TEST(AllFinite, FindsInfAndNanInEveryDtypeAnywhere) {
  for (int64_t n : {int64_t{1}, int64_t{100}, int64_t{300000}}) {
    std::vector<float> f(n, 1.5f);
    std::vector<uint16_t> bf(n, float_to_bf16(1.5f)), hf(n, float_to_fp16(1.5f));
    EXPECT_TRUE(all_finite(f.data(), DType::kFloat32, n));
    EXPECT_TRUE(all_finite(bf.data(), DType::kBFloat16, n));
    EXPECT_TRUE(all_finite(hf.data(), DType::kFloat16, n));
    for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN()}) {
      const int64_t at = n - 1;
      f[at] = bad;
      bf[at] = float_to_bf16(bad);
      hf[at] = float_to_fp16(bad);
      EXPECT_FALSE(all_finite(f.data(), DType::kFloat32, n));
      EXPECT_FALSE(all_finite(bf.data(), DType::kBFloat16, n));
      EXPECT_FALSE(all_finite(hf.data(), DType::kFloat16, n));
      f[at] = 1.5f;
      bf[at] = float_to_bf16(1.5f);
      hf[at] = float_to_fp16(1.5f);
    }
  }
  std::vector<float> largest(8, std::numeric_limits<float>::max());
  EXPECT_TRUE(all_finite(largest.data(), DType::kFloat32, 8));
}

}  // namespace
}  // namespace gx
