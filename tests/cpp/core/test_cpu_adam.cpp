#include <gtest/gtest.h>

#include <chrono>
#include <climits>
#include <cmath>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "core/kernels/cpu_adam.h"
#include "core/errors.h"
#include "core/kernels/half_convert.h"
#include "simd_isas.h"
#include "core/thread_pool.h"

namespace gx {
namespace {

// Straightforward double-precision AdamW/Adam for one element, the reference of the float paths.
struct Ref {
  double p, m, v;
  void step(double g, const AdamHyper& h) {
    g *= h.grad_scale;
    if (h.decoupled_weight_decay) p *= 1 - h.lr * h.weight_decay;
    else g += h.weight_decay * p;
    m = h.beta1 * m + (1 - h.beta1) * g;
    v = h.beta2 * v + (1 - h.beta2) * g * g;
    const double b1 = 1 - std::pow(h.beta1, h.step), b2 = 1 - std::pow(h.beta2, h.step);
    p -= h.lr / b1 * m / (std::sqrt(v) / std::sqrt(b2) + h.eps);
  }
};

struct Case {
  DType grad_dtype;
  bool adamw;
  double weight_decay;
  int64_t numel;
};

class CpuAdam : public ::testing::TestWithParam<Case> {};

TEST_P(CpuAdam, EveryIsaMatchesTheDoubleReferenceAndEachOther) {
  const Case k = GetParam();
  std::mt19937 rng(static_cast<unsigned>(k.numel));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p0(k.numel), g32(k.numel);
  std::vector<uint16_t> g16(k.numel);
  for (int64_t i = 0; i < k.numel; ++i) {
    p0[i] = normal(rng);
    g32[i] = normal(rng) * 0.1f;
    if (k.grad_dtype == DType::kBFloat16) {
      g16[i] = float_to_bf16(g32[i]);
      g32[i] = bf16_to_float(g16[i]);
    } else if (k.grad_dtype == DType::kFloat16) {
      g16[i] = float_to_fp16(g32[i]);
      g32[i] = fp16_to_float(g16[i]);
    }
  }
  std::vector<std::vector<float>> results;
  std::vector<std::vector<uint16_t>> copies;
  for (SimdIsa isa : available_isas()) {
    std::vector<float> p = p0, m(k.numel, 0.0f), v(k.numel, 0.0f);
    std::vector<uint16_t> out(k.numel, 0);
    std::vector<Ref> ref(k.numel);
    for (int64_t i = 0; i < k.numel; ++i) ref[i] = Ref{p0[i], 0, 0};
    AdamHyper h;
    h.lr = 1e-2;
    h.weight_decay = k.weight_decay;
    h.decoupled_weight_decay = k.adamw;
    h.grad_scale = 0.5;
    for (int64_t t = 1; t <= 5; ++t) {
      h.step = t;
      AdamBuffers b{p.data(), m.data(), v.data(),
                    k.grad_dtype == DType::kFloat32 ? static_cast<const void*>(g32.data()) : g16.data(),
                    k.grad_dtype, out.data(), DType::kBFloat16, k.numel};
      cpu_adam_step(h, b, isa);
      for (int64_t i = 0; i < k.numel; ++i) ref[i].step(g32[i], h);
    }
    for (int64_t i = 0; i < k.numel; ++i) {
      ASSERT_NEAR(p[i], ref[i].p, 1e-5 * std::max(1.0, std::abs(ref[i].p))) << to_string(isa) << " i=" << i;
      ASSERT_NEAR(m[i], ref[i].m, 1e-5 * std::max(1e-2, std::abs(ref[i].m))) << to_string(isa) << " i=" << i;
      ASSERT_EQ(out[i], float_to_bf16(p[i])) << "bf16 copy of the updated param, " << to_string(isa);
    }
    results.push_back(p);
    copies.push_back(out);
  }
  for (size_t r = 1; r < results.size(); ++r) {
    EXPECT_EQ(results[r], results[0]) << "every ISA path gives bit-identical params";
    EXPECT_EQ(copies[r], copies[0]);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Grid, CpuAdam,
    ::testing::Values(Case{DType::kFloat32, true, 0.0, 1}, Case{DType::kFloat32, true, 0.1, 17},
                      Case{DType::kFloat32, false, 0.1, 1000}, Case{DType::kBFloat16, true, 0.1, 4099},
                      Case{DType::kBFloat16, false, 0.0, 31}, Case{DType::kFloat16, true, 0.01, 200003},
                      Case{DType::kFloat16, false, 0.1, 15}));

TEST(CpuAdam, OutOfPlaceWritesTheInPlaceResultAndLeavesTheInputs) {
  const int64_t n = 1037;  // not a multiple of any vector width: the scalar tail runs too
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p0(n), m0(n), v0(n), g(n);
  for (int64_t i = 0; i < n; ++i) {
    p0[i] = normal(rng);
    m0[i] = normal(rng) * 0.01f;
    v0[i] = std::abs(normal(rng)) * 1e-4f;
    g[i] = normal(rng) * 0.1f;
  }
  AdamHyper h;
  h.step = 3;
  h.weight_decay = 0.1;
  for (SimdIsa isa : available_isas()) {
    std::vector<float> p = p0, m = m0, v = v0;
    std::vector<uint16_t> in_place16(n), out16(n);
    AdamBuffers in_place{p.data(),        m.data(),          v.data(),         g.data(),
                         DType::kFloat32, in_place16.data(), DType::kBFloat16, n};
    cpu_adam_step(h, in_place, isa);
    // Outputs 3 elements past 64-byte aligned addresses (the SIMD paths peel to alignment, then
    // stream) and exactly at them.
    for (const int64_t shift : {int64_t{3}, int64_t{0}}) {
      std::vector<float> pi = p0, mi = m0, vi = v0;
      std::vector<float> buffer(3 * (n + 64));
      auto base = [&](int k) {
        float* raw = buffer.data() + k * (n + 64);
        raw += (64 - reinterpret_cast<uintptr_t>(raw) % 64) % 64 / sizeof(float);
        return raw + shift;
      };
      float* po = base(0);
      float* mo = base(1);
      float* vo = base(2);
      std::fill(out16.begin(), out16.end(), 0);
      AdamBuffers out{pi.data(), mi.data(), vi.data(), g.data(), DType::kFloat32, out16.data(), DType::kBFloat16, n};
      out.param_out = po;
      out.exp_avg_out = mo;
      out.exp_avg_sq_out = vo;
      cpu_adam_step(h, out, isa);
      EXPECT_EQ(std::vector<float>(po, po + n), p) << to_string(isa) << " shift " << shift;
      EXPECT_EQ(std::vector<float>(mo, mo + n), m) << to_string(isa);
      EXPECT_EQ(std::vector<float>(vo, vo + n), v) << to_string(isa);
      EXPECT_EQ(out16, in_place16) << to_string(isa);
      EXPECT_EQ(pi, p0) << "the inputs are untouched, " << to_string(isa);
      EXPECT_EQ(mi, m0);
      EXPECT_EQ(vi, v0);
    }
  }
  float x = 0, y = 0;
  AdamBuffers partial{&x, &x, &x, &x, DType::kFloat32, nullptr, DType::kBFloat16, 1};
  partial.param_out = &y;  // the moments' outputs missing
  EXPECT_THROW(cpu_adam_step(h, partial), UsageError);
}

TEST(HalfConvert, RoundsToNearestEvenAndKeepsSpecials) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16(bits_to_float(0x3F808000u)), 0x3F80);  // tie, even stays
  EXPECT_EQ(float_to_bf16(bits_to_float(0x3F818000u)), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(float_to_bf16(bits_to_float(0x3F808001u)), 0x3F81);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  EXPECT_EQ(float_to_fp16(1.0f), 0x3C00);
  EXPECT_EQ(float_to_fp16(65504.0f), 0x7BFF);
  EXPECT_EQ(float_to_fp16(70000.0f), 0x7C00);
  EXPECT_EQ(float_to_fp16(-2.0f), 0xC000);
  EXPECT_EQ(float_to_fp16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(fp16_to_float(0x0001), std::ldexp(1.0f, -24));
  for (uint32_t h = 0; h < 0x7C00; h += 7) EXPECT_EQ(float_to_fp16(fp16_to_float(static_cast<uint16_t>(h))), h);
}

TEST(CpuAdamArgs, BadHyperparametersAreUsageErrors) {
  float x = 0;
  AdamBuffers b{&x, &x, &x, &x, DType::kFloat32, nullptr, DType::kBFloat16, 1};
  AdamHyper h;
  h.step = 0;
  EXPECT_THROW(cpu_adam_step(h, b), UsageError);
  h.step = 1;
  h.beta1 = 1.0;
  EXPECT_THROW(cpu_adam_step(h, b), UsageError);
  h.beta1 = 0.9;
  b.grad_dtype = DType::kInt32;
  EXPECT_THROW(cpu_adam_step(h, b), UsageError);
}

TEST(ThreadPool, CoversTheRangeOnceAndRethrows) {
  ThreadPool pool(4);
  std::vector<int> hits(100003, 0);
  pool.parallel_for(static_cast<int64_t>(hits.size()), 1000, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) hits[i] += 1;
  });
  for (int h : hits) ASSERT_EQ(h, 1);
  EXPECT_THROW(pool.parallel_for(100, 1, [](int64_t a, int64_t) {
                 if (a > 0) throw UsageError("boom");
               }),
               UsageError);
  int calls = 0;
  pool.parallel_for(10, 100, [&](int64_t a, int64_t b) { calls += static_cast<int>(b - a); });
  EXPECT_EQ(calls, 10);  // below one grain: run inline
}

TEST(ThreadPool, APreemptedThreadHoldsUpOnlyItsOwnPiece) {
  // Pieces are taken from a shared counter: while the thread that took the first piece stalls,
  // the others take every remaining piece (a fixed 1/size() split would leave its share waiting).
  ThreadPool pool(4);
  std::mutex m;
  std::map<std::thread::id, int> pieces_by_thread;
  std::thread::id stalled;
  int64_t smallest_piece = INT64_MAX;
  pool.parallel_for(1 << 20, 1 << 10, [&](int64_t a, int64_t b) {
    {
      std::lock_guard<std::mutex> lock(m);
      pieces_by_thread[std::this_thread::get_id()] += 1;
      smallest_piece = std::min(smallest_piece, b - a);
      if (a == 0) stalled = std::this_thread::get_id();
    }
    if (a == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  });
  int total = 0;
  for (const auto& [id, n] : pieces_by_thread) total += n;
  EXPECT_EQ(total, 4 * 8);                   // up to 8 pieces per thread
  EXPECT_EQ(pieces_by_thread[stalled], 1);   // the others took the rest meanwhile
  EXPECT_GE(smallest_piece, 1 << 10);        // never below the grain
}

}  // namespace
}  // namespace gx
