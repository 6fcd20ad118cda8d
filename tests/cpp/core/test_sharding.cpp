// Sharded chunks (ChunkManager with a Communicator): ranks are threads, each with its own sim
// device and manager, talking through ThreadCommunicator.
#include <gtest/gtest.h>

#include <functional>
#include <thread>

#include "common/thread_communicator.h"
#include "core/chunk_manager.h"
#include "core/sim_backend.h"

namespace gx {
namespace {

using S = TensorState;

struct Rank {
  Rank(std::shared_ptr<testing::ThreadGroup> group, int rank)
      : comm(group, rank, &sim), mgr(sim, ChunkManagerConfig{group->world_size(), rank, 64, true}) {
    mgr.set_communicator(&comm);
  }
  SimBackend sim{SimConfig{1 << 20, 20, 7}};
  testing::ThreadCommunicator comm;
  ChunkManager mgr;
};

// Runs body(rank) on world_size threads, each with its own Rank; rethrows the first failure.
void run_ranks(int world_size, const std::function<void(Rank&)>& body) {
  auto group = std::make_shared<testing::ThreadGroup>(world_size);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      try {
        Rank rank(group, r);
        body(rank);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// Three tensors of 40, 40 and 30 floats in one chunk of 100 (slots at 0, 48, 96: 126 used).
std::vector<TensorHandle> register_three(ChunkManager& mgr, const std::string& group, Tier home) {
  mgr.create_group(group, DType::kFloat32, 130, home);
  std::vector<TensorHandle> hs;
  for (int64_t n : {40, 40, 30}) hs.push_back(mgr.register_tensor(group, "t" + std::to_string(hs.size()), n, {n}));
  mgr.finalize();
  return hs;
}

TEST(Sharding, ShardsArePaddedEquallyAndConcatenateToTheChunk) {
  run_ranks(3, [](Rank& r) {
    auto hs = register_three(r.mgr, "param", Tier::kPageableHost);
    const Chunk& c = r.mgr.chunk(0);
    // 126 used elements over 3 ranks, shards aligned to 16 floats: 48 each, 144 in all
    ASSERT_EQ(c.shard_numel(), 48);
    ASSERT_EQ(c.padded_numel(), 144);
    ASSERT_EQ(r.mgr.tier_bytes(Tier::kPageableHost).current, 48 * 4) << "a rank holds its shard only";
    // This rank's shard holds global element indices rank*48 + k, as if cut from one chunk.
    auto* shard = static_cast<float*>(c.shard_ptr(Tier::kPageableHost));
    for (int64_t k = 0; k < 48; ++k) shard[k] = static_cast<float>(r.comm.rank() * 48 + k);
    for (auto& h : hs) r.mgr.transition(h, S::kHold);

    r.mgr.access(0);
    ASSERT_TRUE(c.gathered());
    EXPECT_EQ(r.mgr.gathered_bytes().current, 144 * 4);
    EXPECT_EQ(r.mgr.tier_bytes(Tier::kDevice).current, (48 + 144) * 4) << "the shard's device copy and the buffer";
    EXPECT_EQ(r.mgr.traffic().all_gathers, 1);
    auto* full = static_cast<const float*>(c.gathered_ptr());
    for (int64_t k = 0; k < 144; ++k) ASSERT_EQ(full[k], static_cast<float>(k)) << k;
    // A tensor spanning two shards reads whole through the gathered view.
    auto* t2 = static_cast<const float*>(r.mgr.gathered_tensor_ptr(hs[2]));
    EXPECT_EQ(t2[0], 96.0f);
    EXPECT_EQ(t2[29], 125.0f);

    r.mgr.release(0);
    EXPECT_FALSE(c.gathered());
    EXPECT_EQ(r.mgr.gathered_bytes().current, 0);
    EXPECT_EQ(r.mgr.gathered_bytes().peak, 144 * 4);
  });
}

TEST(Sharding, ReleaseWithoutReshardKeepsTheChunkGathered) {
  run_ranks(2, [](Rank& r) {
    auto hs = register_three(r.mgr, "param", Tier::kDevice);
    for (auto& h : hs) r.mgr.transition(h, S::kHold);
    r.mgr.access(0);
    r.mgr.release(0, /*reshard=*/false);
    EXPECT_TRUE(r.mgr.chunk(0).gathered());
    r.mgr.access(0);
    EXPECT_EQ(r.mgr.traffic().all_gathers, 1) << "still gathered: no second gather";
    r.mgr.release(0, /*reshard=*/false);
    r.mgr.ungather(0);
    EXPECT_FALSE(r.mgr.chunk(0).gathered());
    EXPECT_EQ(r.mgr.tier_bytes(Tier::kDevice).current, static_cast<int64_t>(r.mgr.chunk(0).shard_bytes()));
  });
}

TEST(Sharding, ReduceScattersGradientsIntoTheDeviceShard) {
  run_ranks(3, [](Rank& r) {
    auto hs = register_three(r.mgr, "grad", Tier::kPageableHost);
    const Chunk& c = r.mgr.chunk(0);
    r.mgr.allocate_gathered(0);
    auto* full = static_cast<float*>(c.gathered_ptr());
    for (int64_t k = 0; k < c.padded_numel(); ++k) full[k] = static_cast<float>((r.comm.rank() + 1) * k);
    for (auto& h : hs) {
      r.mgr.transition(h, S::kHold);
      r.mgr.transition(h, S::kCompute);
      r.mgr.transition(h, S::kHoldAfterBwd);
      r.mgr.transition(h, S::kReadyForReduce);
    }
    r.mgr.reduce_scatter(0);
    EXPECT_FALSE(c.gathered()) << "the gathered buffer goes once reduced";
    r.mgr.reduce(0);
    ASSERT_TRUE(c.shard_tiers().contains(Tier::kDevice));
    auto* shard = static_cast<const float*>(c.shard_ptr(Tier::kDevice));
    for (int64_t k = 0; k < c.shard_numel(); ++k)  // (1 + 2 + 3) * global index
      ASSERT_EQ(shard[k], 6.0f * static_cast<float>(r.comm.rank() * c.shard_numel() + k)) << k;
    EXPECT_EQ(r.mgr.state(hs[0]), S::kHold);
    EXPECT_EQ(r.mgr.traffic().reduce_scatters, 1);
  });
}

TEST(Sharding, APrefetchedGatherIsWaitedForAtAccess) {
  run_ranks(2, [](Rank& r) {
    auto hs = register_three(r.mgr, "param", Tier::kPageableHost);
    const Chunk& c = r.mgr.chunk(0);
    auto* shard = static_cast<float*>(c.shard_ptr(Tier::kPageableHost));
    for (int64_t k = 0; k < c.shard_numel(); ++k) shard[k] = static_cast<float>(r.comm.rank() * c.shard_numel() + k);
    for (auto& h : hs) r.mgr.transition(h, S::kHold);
    r.mgr.prefetch_gather(0);  // the shard's copy and the gather, both on the side stream
    EXPECT_TRUE(c.gathered());
    EXPECT_TRUE(r.mgr.gather_in_flight(0));
    r.mgr.access(0);
    EXPECT_FALSE(r.mgr.gather_in_flight(0));
    EXPECT_EQ(r.mgr.traffic().all_gathers, 1);
    EXPECT_EQ(r.mgr.traffic().gather_prefetches, 1);
    EXPECT_EQ(r.mgr.traffic().prefetch_hits, 1);
    auto* full = static_cast<const float*>(c.gathered_ptr());
    for (int64_t k = 0; k < c.padded_numel(); ++k) ASSERT_EQ(full[k], static_cast<float>(k)) << k;
    r.mgr.release(0);
    // Prefetched and never used: dropping it is safe and leaves nothing in flight.
    r.mgr.prefetch_gather(0);
    r.mgr.ungather(0);
    EXPECT_FALSE(r.mgr.gather_in_flight(0));
    EXPECT_EQ(r.mgr.gathered_bytes().current, 0);
  });
}

TEST(Sharding, ACommunicatorOfAnotherShapeIsRefused) {
  auto group = std::make_shared<testing::ThreadGroup>(2);
  testing::ThreadCommunicator comm(group, 1);
  SimBackend sim{SimConfig{1 << 20, 0, 1}};
  ChunkManager mgr(sim, ChunkManagerConfig{2, 0, 64, true});
  EXPECT_THROW(mgr.set_communicator(&comm), UsageError);
  ChunkManager unsharded(sim, ChunkManagerConfig{1, 0, 64, true});
  unsharded.create_group("p", DType::kFloat32, 16, Tier::kDevice);
  unsharded.register_tensor("p", "x", 8, {8});
  unsharded.finalize();
  EXPECT_THROW(unsharded.allocate_gathered(0), UsageError);
  EXPECT_THROW(unsharded.set_communicator(&comm), UsageError) << "after finalize";
}

}  // namespace
}  // namespace gx
