// Residency (core/residency.h) driven as the manager drives it, over a real ChunkManager on the
// sim backend with a byte budget: the exact fetch, prefetch and eviction sequences, what may be
// evicted, the last-resort ladder, settling a pending CPU step, and the out-of-memory message.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/residency.h"
#include "core/sim_backend.h"

namespace gx {
namespace {

using S = TensorState;

constexpr int64_t kChunkNumel = 4096;
constexpr int64_t kChunkBytes = kChunkNumel * 4;  // fp32

SimConfig sim_of(size_t capacity_bytes) {
  SimConfig c;
  c.capacity_bytes = capacity_bytes;
  return c;
}

// `layers` one-tensor layers, each a chunk set of P (fp32, its own master), G and Adam's two
// state chunks, so that the parameter chunks are 0, 4, 8, ... as in the engine's own layout of
// a stack of bias-free Linear layers. The optimizer state lives on the host; P's host copy is
// permanent and its device copy a cache. The methods follow the manager's hook bodies.
class Rig {
 public:
  Rig(int layers, int64_t budget_bytes, int max_prefetch)
      : backend_(sim_of(size_t{1} << 24)),
        mgr_(backend_, ChunkManagerConfig{}),
        pipeline_([](int) {}, [](int s) { return "set " + std::to_string(s); }) {
    for (const char* g : {"p", "g", "m", "v"}) mgr_.create_group(g, DType::kFloat32, kChunkNumel, mgr_.host_tier());
    std::vector<ChunkId> grads;
    for (int i = 0; i < layers; ++i) {
      ChunkSet set;
      set.trainable = true;
      set.spec.param = mgr_.register_tensor("p", "w" + std::to_string(i), kChunkNumel, {64, 64}).chunk_id;
      set.spec.grad = mgr_.register_tensor("g", "w" + std::to_string(i), kChunkNumel, {64, 64}).chunk_id;
      set.spec.states = {
          {StateKind::kExpAvg, mgr_.register_tensor("m", "w" + std::to_string(i), kChunkNumel, {64, 64}).chunk_id},
          {StateKind::kExpAvgSq, mgr_.register_tensor("v", "w" + std::to_string(i), kChunkNumel, {64, 64}).chunk_id}};
      set.params = {i};
      set.has_grad = {0};
      set.step = {0};
      grads.push_back(set.spec.grad);
      sets_.push_back(set);
    }
    mgr_.finalize({}, grads);  // gradients are born on the device in backward
    for (const ChunkSet& set : sets_) mgr_.transition({set.spec.param, 0}, S::kHold);  // filled
    set_of_p_chunk_.assign(mgr_.num_chunks(), -1);
    for (size_t s = 0; s < sets_.size(); ++s) set_of_p_chunk_[static_cast<size_t>(sets_[s].spec.param)] = int(s);
    residency_ = std::make_unique<Residency>(backend_, mgr_, sets_, set_of_p_chunk_, trace_, pipeline_, timeline_,
                                             policy_);
    residency_->set_budget(budget_bytes);
    residency_->set_max_prefetch(max_prefetch);
    pipeline_.set_overlap(true);
  }

  // The engine's initial placement: every parameter chunk's device cache, in set order.
  void place() {
    for (const ChunkSet& set : sets_) {
      residency_->ensure_on_device(set.spec.param);
      mgr_.release(set.spec.param);
    }
  }

  ChunkId p(int layer) const { return sets_[static_cast<size_t>(layer)].spec.param; }
  ChunkId g(int layer) const { return sets_[static_cast<size_t>(layer)].spec.grad; }

  void fetch_for_compute(int layer) {
    const ChunkId c = p(layer);
    trace_.record(c);
    pipeline_.settle(layer);  // its CPU step, if still running
    residency_->ensure_on_device(c);
    if (mgr_.state({c, 0}) != S::kCompute) mgr_.transition({c, 0}, S::kCompute);
    residency_->prefetch();
  }
  void forward(int layer) {
    fetch_for_compute(layer);
    mgr_.transition({p(layer), 0}, S::kHold);
    residency_->release_if_idle(p(layer));
  }
  // The layer's gradient arrives: G is allocated on the device on first use, the tensor is ready
  // for reduction, and (unless `collect` keeps the chunk collecting) the chunk is reduced and G
  // leaves for the host, where the optimizer state is.
  void grad_arrives(int layer, bool collect = false) {
    ChunkSet& set = sets_[static_cast<size_t>(layer)];
    if (set.grad_place == GradPlace::kNone) {
      residency_->allocate_on_device(set.spec.grad);
      set.grad_place = GradPlace::kDevice;
    }
    set.has_grad[0] = 1;
    mgr_.transition({p(layer), 0}, S::kReadyForReduce);
    if (collect) return;
    mgr_.reduce(p(layer));
    set.reduced = true;
    if (mgr_.chunk(set.spec.grad).shard_tiers().contains(mgr_.host_tier()))
      mgr_.discard_copy(set.spec.grad, mgr_.host_tier());
    mgr_.move(set.spec.grad, mgr_.host_tier());
    set.grad_place = GradPlace::kHost;
  }
  void backward(int layer) {
    fetch_for_compute(layer);
    grad_arrives(layer);
    residency_->release_if_idle(p(layer));
  }
  void end_backward() {
    for (ChunkSet& set : sets_) {
      const ChunkId c = set.spec.param;
      if (mgr_.chunk(c).slot(0).state != S::kHold) mgr_.transition({c, 0}, S::kHold);
      set.reduced = false;
      residency_->release_if_idle(c);
    }
  }
  // The iteration's end, then each host set's CPU step handed to the pipeline (it writes P's
  // host copy; settling refreshes the device cache) and finished, then zero_grad.
  void step() {
    timeline_.note('S', -1, mgr_.tier_bytes(Tier::kDevice).current);
    trace_.end_iteration();
    for (size_t s = 0; s < sets_.size(); ++s) {
      const ChunkId c = sets_[s].spec.param;
      pipeline_.launch(
          int(s), [] {},
          [this, c] {
            if (mgr_.chunk(c).shard_tiers().contains(Tier::kDevice))
              mgr_.transfer(c, mgr_.host_tier(), Tier::kDevice, /*async=*/true);
          },
          nullptr, int64_t(s));
    }
    // The steps' compute parts end here, before the next forward: what prefetch may fetch depends
    // on which sets' steps finished (a pending set's P is not prefetched), so letting the executor
    // thread race the next forward would make the traces depend on the machine's load.
    pipeline_.drain();
    for (ChunkSet& set : sets_) {
      set.has_grad[0] = 0;
      if (set.grad_place == GradPlace::kNone) continue;
      mgr_.wait(set.spec.grad);
      if (mgr_.chunk(set.spec.grad).shard_tiers().contains(Tier::kDevice))
        mgr_.discard_copy(set.spec.grad, Tier::kDevice);
      set.grad_place = GradPlace::kNone;
    }
  }
  void iteration() {
    const int n = int(sets_.size());
    for (int i = 0; i < n; ++i) forward(i);
    for (int i = n - 1; i >= 0; --i) backward(i);
    end_backward();
    step();
  }

  // The timeline as "F<chunk>" / "E<chunk>" / "P<chunk>", one list per iteration ('S' ends one).
  std::vector<std::vector<std::string>> iterations() const {
    std::vector<std::vector<std::string>> out(1);
    for (const TimelineEvent& e : timeline_.events()) {
      if (e.kind == 'S') {
        out.emplace_back();
      } else {
        out.back().push_back(std::string(1, e.kind) + std::to_string(e.chunk));
      }
    }
    return out;
  }
  int64_t device_peak() const {
    int64_t peak = 0;
    for (const TimelineEvent& e : timeline_.events()) peak = std::max(peak, e.device_bytes);
    return peak;
  }

  SimBackend backend_;
  ChunkManager mgr_;
  std::vector<ChunkSet> sets_;
  std::vector<int> set_of_p_chunk_;
  AccessTrace trace_;
  OptimizerPipeline pipeline_;
  Timeline timeline_;
  std::string policy_ = "const";
  std::unique_ptr<Residency> residency_;
};

using Trace = std::vector<std::string>;

TEST(Residency, UnderThreeChunksEvictsByFarthestNextUseOnceTheTraceIsRecorded) {
  Rig rig(4, 3 * kChunkBytes, /*max_prefetch=*/0);
  rig.place();
  for (int k = 0; k < 3; ++k) rig.iteration();
  const auto it = rig.iterations();
  ASSERT_EQ(it.size(), 4u);
  // The placement fills three chunks and evicts 0 for 12 (LRU); the warm-up has no trace, so
  // each fetch evicts the chunk used longest ago.
  EXPECT_EQ(it[0], (Trace{"F0", "F4", "F8", "E0", "F12",                      // placement
                          "E4", "F0", "E8", "F4", "E12", "F8", "E0", "F12",   // forward
                          "E4", "F4", "E12", "F0", "E8"}));                   // backward
  // Recorded: 12 evicts 0 (needed last), layer 3's gradient evicts 4 (needed after 8), 4 in
  // backward evicts 12 (never again), 0 evicts 8 (no further use, least recently used).
  const Trace steady{"F8", "E0", "F12", "E4", "F4", "E12", "F0", "E8"};
  EXPECT_EQ(it[1], steady);
  EXPECT_EQ(it[2], steady);
  EXPECT_LE(rig.device_peak(), 3 * kChunkBytes);
  EXPECT_EQ(rig.residency_->counters().evictions, 8 + 4 + 4);
}

TEST(Residency, UnderTwoChunksOneParameterChunkAndOneGradientChunkTrain) {
  Rig rig(4, 2 * kChunkBytes, /*max_prefetch=*/0);
  rig.place();
  for (int k = 0; k < 3; ++k) rig.iteration();
  const auto it = rig.iterations();
  EXPECT_EQ(it[0], (Trace{"F0", "F4", "E0", "F8", "E4", "F12",                 // placement
                          "E8", "F0", "E12", "F4", "E0", "F8", "E4", "F12",    // forward (LRU)
                          "E8", "F8", "E12", "F4", "E8", "F0", "E4"}));        // backward
  const Trace steady{"F4", "E0", "F8", "E4", "F12", "E8", "F8", "E12", "F4", "E8", "F0", "E4"};
  EXPECT_EQ(it[1], steady);
  EXPECT_EQ(it[2], steady);
  EXPECT_LE(rig.device_peak(), 2 * kChunkBytes);
}

TEST(Residency, PrefetchFollowsTheTraceWithinTheBudgetAndIsDeterministic) {
  auto run = [] {
    Rig rig(4, 3 * kChunkBytes, /*max_prefetch=*/2);
    rig.place();
    for (int k = 0; k < 3; ++k) rig.iteration();
    EXPECT_LE(rig.device_peak(), 3 * kChunkBytes);
    return rig.iterations();
  };
  const auto it = run();
  auto count = [](const Trace& t, char kind) {
    return std::count_if(t.begin(), t.end(), [&](const std::string& e) { return e[0] == kind; });
  };
  EXPECT_EQ(count(it[0], 'P'), 0) << "no trace during the warm-up, no prefetch";
  EXPECT_GT(count(it[2], 'P'), 0);
  EXPECT_LT(count(it[2], 'F'), count(it[0], 'F') - 3) << "prefetches replace synchronous fetches";
  EXPECT_EQ(run(), it);
}

TEST(Residency, AHostHomeChunkUsedAgainWithinAFewAccessesStays) {
  // Forward-only passes (a generation) over host-home sets, where layers 0 and 1 alternate as a
  // layer whose parameters straddle two chunks does. Without a trace each move to another chunk
  // sends the idle ones home; once the pass is recorded, a chunk used again within
  // Residency::kSoonAccesses stays, and each chunk is fetched once a pass.
  Rig rig(4, 4 * kChunkBytes, /*max_prefetch=*/0);
  rig.place();
  for (ChunkSet& set : rig.sets_) set.spec.param_home_on_host = true;
  auto pass = [&] {
    for (int layer : {0, 1, 0, 1, 2, 3}) rig.forward(layer);
    rig.timeline_.note('S', -1, rig.mgr_.tier_bytes(Tier::kDevice).current);
    rig.trace_.end_iteration();
  };
  for (int k = 0; k < 3; ++k) pass();
  const auto it = rig.iterations();
  ASSERT_EQ(it.size(), 4u);  // the placement and the first pass, two recorded passes, nothing after
  EXPECT_EQ(std::count(it[0].begin(), it[0].end(), "F4"), 3) << "no trace: 4 goes home between its uses";
  // Recorded: 0 and 4 stay through their alternation and go home once the pass leaves them; 8
  // goes when 12 computes; 12, last in the pass, waits on the device for the next one.
  const Trace steady{"F0", "F4", "E0", "E4", "F8", "E8"};
  EXPECT_EQ(it[1], steady);
  EXPECT_EQ(it[2], steady);
}

TEST(Residency, WhatComputesOrIsPinnedIsNeverEvicted) {
  Rig rig(3, 2 * kChunkBytes, 0);
  rig.fetch_for_compute(0);  // in compute
  rig.residency_->ensure_on_device(rig.p(1));
  rig.residency_->pin(rig.p(1));  // the optimizer works on it
  try {
    rig.residency_->ensure_on_device(rig.p(2));
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("out of device memory for chunk 8 (16384 bytes) under the 'const' policy"), std::string::npos)
        << what;
    EXPECT_NE(what.find("the device budget is 32768 bytes and chunks hold 32768 bytes of it"), std::string::npos)
        << what;
    EXPECT_NE(what.find("1 parameter chunks in use by compute (16384 bytes)"), std::string::npos) << what;
    // The floor: chunk 0 in compute plus the requested chunk 8, and one gradient chunk.
    EXPECT_NE(what.find("about 49152 bytes: 2 parameter chunk(s)"), std::string::npos) << what;
    EXPECT_NE(what.find("Raise gpu_memory_limit"), std::string::npos) << what;
  }
  EXPECT_TRUE(rig.mgr_.chunk(rig.p(0)).shard_tiers().contains(Tier::kDevice));
  EXPECT_TRUE(rig.mgr_.chunk(rig.p(1)).shard_tiers().contains(Tier::kDevice));
  rig.residency_->unpin_all();
  rig.residency_->ensure_on_device(rig.p(2));
  EXPECT_FALSE(rig.mgr_.chunk(rig.p(1)).shard_tiers().contains(Tier::kDevice)) << "unpinned, it could go";
}

TEST(Residency, ChunksOfASetStillCollectingGradientsGoOnlyAsTheLastResort) {
  Rig rig(3, 3 * kChunkBytes, 0);
  rig.fetch_for_compute(1);
  rig.grad_arrives(1, /*collect=*/true);  // G1 on the device, P1 waiting for the rest of its gradients
  rig.fetch_for_compute(0);
  ASSERT_EQ(rig.mgr_.tier_bytes(Tier::kDevice).current, 3 * kChunkBytes);
  // Room for G0: P0 computes and set 1 is still collecting, so nothing is evictable; the ladder's
  // last rung moves a collecting chunk out, the one used farthest ahead: G1 (never accessed for
  // compute) goes to the host, where later gradients are added.
  rig.residency_->allocate_on_device(rig.g(0));
  EXPECT_EQ(rig.iterations().back().back(), "E5");
  EXPECT_EQ(rig.sets_[1].grad_place, GradPlace::kHost);
  EXPECT_TRUE(rig.mgr_.chunk(rig.p(1)).shard_tiers().contains(Tier::kDevice));
  // Then P1 itself (fetched again for the tensors whose backward is still to come).
  rig.residency_->ensure_on_device(rig.p(2));
  EXPECT_EQ(rig.iterations().back().back(), "F8");
  EXPECT_FALSE(rig.mgr_.chunk(rig.p(1)).shard_tiers().contains(Tier::kDevice));
  EXPECT_LE(rig.device_peak(), 3 * kChunkBytes);
}

TEST(Residency, GradientsKeptOnTheDeviceStayWhereTheHostHasNoRoom) {
  Rig rig(2, 2 * kChunkBytes, 0);
  rig.sets_[1].spec.grad_stays_on_device = true;
  rig.fetch_for_compute(1);
  rig.residency_->allocate_on_device(rig.g(1));
  rig.sets_[1].grad_place = GradPlace::kDevice;
  rig.mgr_.transition({rig.p(1), 0}, S::kHold);
  rig.residency_->release_if_idle(rig.p(1));
  rig.fetch_for_compute(0);  // evicts P1, not G1
  EXPECT_TRUE(rig.mgr_.chunk(rig.g(1)).shard_tiers().contains(Tier::kDevice));
  EXPECT_FALSE(rig.mgr_.chunk(rig.p(1)).shard_tiers().contains(Tier::kDevice));
  EXPECT_THROW(rig.residency_->allocate_on_device(rig.g(0)), OutOfMemoryError)
      << "P0 computes and G1 may not leave: nothing can go";
}

TEST(Residency, APendingCpuStepIsSettledWhenNothingElseCanGo) {
  Rig rig(2, 2 * kChunkBytes, 0);
  rig.fetch_for_compute(0);
  rig.residency_->ensure_on_device(rig.p(1));
  rig.residency_->pin(rig.p(1));
  rig.pipeline_.hold(true);  // set 1's CPU step has not run yet
  bool settled = false;
  rig.pipeline_.launch(1, [] {}, [&] { settled = true; }, nullptr, 0);
  rig.pipeline_.hold(false);
  ASSERT_TRUE(rig.pipeline_.pending(1));
  EXPECT_TRUE(rig.residency_->evict_once(-1)) << "settling is a way to make room";
  EXPECT_TRUE(settled);
  EXPECT_FALSE(rig.pipeline_.pending(1));
  EXPECT_FALSE(rig.residency_->evict_once(-1)) << "P0 computes, P1 is pinned: nothing left";
}

TEST(Residency, LoweringTheBudgetEvictsWhatCanGoNow) {
  Rig rig(3, 0, 0);  // 0: the whole (sim) device
  rig.place();
  EXPECT_EQ(rig.mgr_.tier_bytes(Tier::kDevice).current, 3 * kChunkBytes);
  rig.residency_->set_budget(kChunkBytes);
  EXPECT_EQ(rig.mgr_.tier_bytes(Tier::kDevice).current, kChunkBytes);
  EXPECT_EQ(rig.residency_->budget(), kChunkBytes);
  EXPECT_EQ(rig.residency_->counters().evictions, 2);
  EXPECT_THROW(rig.residency_->set_budget(-1), UsageError);
}

TEST(Residency, HeldParameterChunksStayUntilLetGoAndNothingIsHeldWhereOneIsOff) {
  Rig rig(3, 0, 0);
  rig.place();
  rig.residency_->set_budget(2 * kChunkBytes);  // one parameter chunk goes
  EXPECT_FALSE(rig.residency_->hold_params()) << "chunk 0 is on the host: nothing is held";
  EXPECT_TRUE(rig.residency_->evict_once(-1)) << "not held: a parameter chunk may still go";
  rig.residency_->set_budget(0);
  rig.place();
  ASSERT_TRUE(rig.residency_->hold_params());
  const int64_t evictions = rig.residency_->counters().evictions;
  EXPECT_FALSE(rig.residency_->evict_once(-1)) << "held: no parameter chunk may go";
  rig.residency_->set_budget(kChunkBytes);  // a lower budget evicts what can go now: nothing
  EXPECT_EQ(rig.mgr_.tier_bytes(Tier::kDevice).current, 3 * kChunkBytes);
  EXPECT_EQ(rig.residency_->counters().evictions, evictions);
  rig.residency_->release_params();
  rig.residency_->set_budget(kChunkBytes);
  EXPECT_EQ(rig.mgr_.tier_bytes(Tier::kDevice).current, kChunkBytes);
}

}  // namespace
}  // namespace gx
