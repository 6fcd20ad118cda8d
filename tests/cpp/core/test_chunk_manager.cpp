#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "core/chunk_manager.h"
#include "core/sim_backend.h"

namespace gx {
namespace {

using S = TensorState;

class ChunkManagerTest : public ::testing::Test {
 protected:
  SimBackend sim{SimConfig{1 << 20, 50, 11}};  // 1 MiB device, random copy delays
  ChunkManager mgr{sim, ChunkManagerConfig{1, 0, 64, true}};  // 64-byte alignment: 16 floats

  // Registers float32 tensors of the given numels into group "param" (chunk size 100).
  std::vector<TensorHandle> register_floats(const std::vector<int64_t>& numels, Tier home = Tier::kDevice) {
    mgr.create_group("param", DType::kFloat32, 100, home);
    std::vector<TensorHandle> handles;
    for (size_t i = 0; i < numels.size(); ++i)
      handles.push_back(mgr.register_tensor("param", "t" + std::to_string(i), numels[i], {numels[i]}));
    mgr.finalize();
    return handles;
  }

  // Writes value i + k into element k of tensor i on `tier` and moves it to HOLD.
  void fill(const std::vector<TensorHandle>& hs, Tier tier) {
    for (size_t i = 0; i < hs.size(); ++i) {
      const auto& slot = mgr.chunk(hs[i].chunk_id).slot(hs[i].slot_index);
      auto* p = static_cast<float*>(mgr.tensor_ptr(hs[i], tier));
      for (int64_t k = 0; k < slot.numel; ++k) p[k] = static_cast<float>(i * 1000 + k);
      mgr.transition(hs[i], S::kHold);
    }
  }
  void expect_values(const std::vector<TensorHandle>& hs, Tier tier) {
    for (size_t i = 0; i < hs.size(); ++i) {
      const auto& slot = mgr.chunk(hs[i].chunk_id).slot(hs[i].slot_index);
      auto* p = static_cast<float*>(mgr.tensor_ptr(hs[i], tier));
      for (int64_t k = 0; k < slot.numel; ++k) ASSERT_EQ(p[k], static_cast<float>(i * 1000 + k)) << i << "," << k;
    }
  }
};

TEST_F(ChunkManagerTest, PacksTensorsInOrderAndGivesOversizedOnesTheirOwnChunk) {
  auto hs = register_floats({40, 40, 30, 250, 10});
  // chunk 0: t0 @0, t1 @48 (aligned to 16 floats = 64 bytes); t2 does not fit (96 + 30 > 100)
  EXPECT_EQ(hs[0].chunk_id, 0);
  EXPECT_EQ(hs[1].chunk_id, 0);
  EXPECT_EQ(mgr.chunk(0).slot(1).offset_numel, 48);
  EXPECT_EQ(hs[2].chunk_id, 1);
  EXPECT_EQ(hs[3].chunk_id, 2);  // oversized: own chunk of 250 (+ alignment padding)
  EXPECT_EQ(mgr.chunk(2).capacity_numel(), 250);
  EXPECT_EQ(mgr.chunk(2).padded_numel(), 256);
  EXPECT_EQ(hs[4].chunk_id, 1) << "the open chunk stays open after an oversized tensor";
  EXPECT_EQ(mgr.group("param").chunk_ids, (std::vector<ChunkId>{0, 1, 2}));
  // chunks of 100 floats pad to 112 (aligned to 16); 256 for the big one
  EXPECT_EQ(mgr.tier_bytes(Tier::kDevice).current, (112 + 112 + 256) * 4);
  EXPECT_EQ(mgr.wasted_bytes(), ((112 + 112 + 256) - (40 + 40 + 30 + 250 + 10)) * 4);
}

TEST_F(ChunkManagerTest, MovesPreserveBytesAndAccountingIsExact) {
  auto hs = register_floats({40, 40, 30, 10});
  fill(hs, Tier::kDevice);
  const int64_t chunk_bytes = 112 * 4;
  for (ChunkId c : {0, 1}) mgr.move(c, Tier::kPageableHost);
  EXPECT_EQ(mgr.tier_bytes(Tier::kDevice).current, 0);
  EXPECT_EQ(mgr.tier_bytes(Tier::kPageableHost).current, 2 * chunk_bytes);
  EXPECT_EQ(mgr.traffic().d2h_bytes, 2 * chunk_bytes);
  expect_values(hs, Tier::kPageableHost);
  for (ChunkId c : {0, 1}) mgr.move(c, Tier::kDevice);
  EXPECT_EQ(mgr.traffic().h2d_bytes, 2 * chunk_bytes);
  EXPECT_EQ(mgr.tier_bytes(Tier::kDevice).current, 2 * chunk_bytes);
  EXPECT_EQ(mgr.tier_bytes(Tier::kPageableHost).current, 0);
  EXPECT_EQ(mgr.tier_bytes(Tier::kDevice).peak, 2 * chunk_bytes);
  EXPECT_EQ(mgr.traffic().moves, 4);
  expect_values(hs, Tier::kDevice);
}

TEST_F(ChunkManagerTest, RepeatedMovesReuseThePoolSlots) {
  auto hs = register_floats({40, 40, 30});
  fill(hs, Tier::kDevice);
  for (int round = 0; round < 20; ++round) {
    mgr.move(0, Tier::kPageableHost, /*async=*/true);
    mgr.move(1, Tier::kPageableHost, /*async=*/true);
    mgr.move(0, Tier::kDevice, /*async=*/true);
    mgr.move(1, Tier::kDevice, /*async=*/true);
  }
  mgr.wait(0);
  mgr.wait(1);
  expect_values(hs, Tier::kDevice);
  EXPECT_EQ(mgr.num_chunks(), 2u);
  EXPECT_EQ(mgr.allocator().upstream_allocations(Tier::kDevice), 2u) << "one device slot per chunk, reused";
  EXPECT_LE(mgr.allocator().upstream_allocations(Tier::kPageableHost), 2u);
}

TEST_F(ChunkManagerTest, AsyncMoveCompletesOnWaitAndFreesTheSource) {
  auto hs = register_floats({40});
  fill(hs, Tier::kDevice);
  mgr.move(0, Tier::kPageableHost, /*async=*/true);
  EXPECT_TRUE(mgr.in_flight(0));
  EXPECT_TRUE(mgr.chunk(0).shard_tiers().contains(Tier::kDevice)) << "source kept until the copy is done";
  mgr.wait(0);
  EXPECT_FALSE(mgr.in_flight(0));
  EXPECT_FALSE(mgr.chunk(0).shard_tiers().contains(Tier::kDevice));
  EXPECT_EQ(mgr.tier_bytes(Tier::kDevice).current, 0);
  expect_values(hs, Tier::kPageableHost);
}

TEST_F(ChunkManagerTest, CopyEventCoversTheMoveInFlightAndThenIsGone) {
  auto hs = register_floats({40});
  fill(hs, Tier::kDevice);
  EXPECT_EQ(mgr.copy_event(0), nullptr);
  mgr.move(0, Tier::kPageableHost, /*async=*/true);
  auto event = mgr.copy_event(0);
  ASSERT_NE(event, nullptr);
  event->synchronize();  // another thread may wait on it; the host copy is complete after it
  const float* host = static_cast<const float*>(mgr.chunk(0).shard_ptr(Tier::kPageableHost));
  EXPECT_EQ(host[39], 39.0f);
  mgr.wait(0);
  EXPECT_EQ(mgr.copy_event(0), nullptr);
}

TEST_F(ChunkManagerTest, ExchangeCopySwapsInASpareOfTheSamePool) {
  auto hs = register_floats({40, 40});
  fill(hs, Tier::kDevice);
  mgr.move(0, Tier::kPageableHost);
  void* original = mgr.chunk(0).shard_ptr(Tier::kPageableHost);
  void* spare = mgr.allocate_spare(0, Tier::kPageableHost);
  ASSERT_NE(spare, original);
  const int64_t in_use = mgr.allocator().in_use_bytes(Tier::kPageableHost).current;
  auto* s = static_cast<float*>(spare);
  for (int k = 0; k < 112; ++k) s[k] = -static_cast<float>(k);  // the "updated" values
  EXPECT_EQ(mgr.exchange_copy(0, Tier::kPageableHost, spare), original);
  EXPECT_EQ(mgr.chunk(0).shard_ptr(Tier::kPageableHost), spare);
  EXPECT_EQ(mgr.tier_bytes(Tier::kPageableHost).current, 112 * 4) << "chunk bytes unchanged by an exchange";
  mgr.move(0, Tier::kDevice);  // the exchanged-in values are the chunk's now
  EXPECT_EQ(static_cast<const float*>(mgr.tensor_ptr(hs[1], Tier::kDevice))[3], -51.0f);
  mgr.release_spare(0, Tier::kPageableHost, original);
  // the move dropped the host copy (the former spare), the release gave the former copy back
  EXPECT_EQ(mgr.allocator().in_use_bytes(Tier::kPageableHost).current, in_use - 2 * 112 * 4);
  EXPECT_THROW(mgr.exchange_copy(0, Tier::kPageableHost, original), InternalError) << "no host copy any more";
}

TEST_F(ChunkManagerTest, AccessFetchesFromHostAndReleaseDropsTheGatheredView) {
  auto hs = register_floats({40, 40}, Tier::kPageableHost);
  fill(hs, Tier::kPageableHost);
  EXPECT_EQ(mgr.tier_bytes(Tier::kDevice).current, 0);
  for (auto& h : hs) mgr.transition(h, S::kCompute);
  mgr.access(0);
  EXPECT_TRUE(mgr.chunk(0).gathered());
  EXPECT_EQ(mgr.traffic().fetches, 1);
  EXPECT_EQ(mgr.traffic().h2d_bytes, 112 * 4);
  auto* p = static_cast<float*>(mgr.gathered_tensor_ptr(hs[1]));
  EXPECT_EQ(p[5], 1005.0f) << "compute sees the fetched bytes";
  EXPECT_THROW(mgr.release(0), InternalError) << "tensors still in COMPUTE";
  EXPECT_THROW(mgr.move(0, Tier::kPageableHost), InternalError) << "a COMPUTE chunk never moves";
  for (auto& h : hs) mgr.transition(h, S::kHold);
  mgr.release(0);
  EXPECT_FALSE(mgr.chunk(0).gathered());
  EXPECT_THROW(mgr.gathered_tensor_ptr(hs[0]), UsageError);
  mgr.access(0);
  EXPECT_EQ(mgr.traffic().fetches, 1) << "second access finds the shard on the device";
  mgr.release(0);
}

TEST_F(ChunkManagerTest, ReduceNeedsEveryTensorReady) {
  auto hs = register_floats({40, 40});
  fill(hs, Tier::kDevice);
  mgr.transition(hs[0], S::kReadyForReduce);
  EXPECT_THROW(mgr.reduce(0), InternalError);
  mgr.transition(hs[1], S::kReadyForReduce);
  mgr.reduce(0);
  EXPECT_EQ(mgr.state(hs[0]), S::kHold);
  EXPECT_EQ(mgr.state(hs[1]), S::kHold);
  EXPECT_EQ(mgr.traffic().reductions, 1);
}

TEST_F(ChunkManagerTest, DeviceCapacityIsOutOfMemoryNamingTheKnob) {
  mgr.create_group("param", DType::kFloat32, 100000, Tier::kPageableHost);  // 400 KB chunks
  for (int i = 0; i < 4; ++i) mgr.register_tensor("param", "w" + std::to_string(i), 100000, {100000});
  mgr.finalize();
  mgr.move(0, Tier::kDevice);
  mgr.move(1, Tier::kDevice);
  try {
    mgr.move(2, Tier::kDevice);  // 1.2 MB > 1 MiB
    FAIL();
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("sim_capacity"), std::string::npos) << e.what();
  }
  EXPECT_EQ(mgr.tier_bytes(Tier::kDevice).current, 2 * 400000) << "the failed move left no accounting behind";
  EXPECT_TRUE(mgr.chunk(2).shard_tiers().contains(Tier::kPageableHost));
}

TEST_F(ChunkManagerTest, FinalizePlacesNamedChunksOnTheDeviceOrNowhereInsteadOfTheirHome) {
  mgr.create_group("param", DType::kFloat32, 100, Tier::kPageableHost);
  std::vector<TensorHandle> hs;
  for (int i = 0; i < 3; ++i) hs.push_back(mgr.register_tensor("param", "t" + std::to_string(i), 100, {100}));
  mgr.close_chunks();
  EXPECT_EQ(mgr.chunk(1).shard_numel(), 112) << "layouts are known before any memory is taken";
  EXPECT_EQ(mgr.tier_bytes(Tier::kPageableHost).current, 0);
  mgr.finalize({1}, {2});
  EXPECT_TRUE(mgr.chunk(0).shard_tiers().contains(Tier::kPageableHost));
  EXPECT_TRUE(mgr.chunk(2).shard_tiers().empty()) << "without a copy until someone allocates one";
  EXPECT_TRUE(mgr.chunk(1).shard_tiers().contains(Tier::kDevice));
  EXPECT_FALSE(mgr.chunk(1).shard_tiers().contains(Tier::kPageableHost));
  EXPECT_EQ(mgr.tier_bytes(Tier::kDevice).current, 112 * 4);
  EXPECT_EQ(mgr.tier_bytes(Tier::kPageableHost).current, 112 * 4);
  mgr.allocate_copy(2, Tier::kDevice);
  EXPECT_TRUE(mgr.chunk(2).shard_tiers().contains(Tier::kDevice));
  // The device copy starts zeroed like a host one, and moves like any other copy.
  const auto* zero = static_cast<const float*>(mgr.tensor_ptr(hs[1], Tier::kDevice));
  for (int k = 0; k < 112; ++k) ASSERT_EQ(zero[k], 0.0f);
  mgr.move(1, Tier::kPageableHost);
  EXPECT_EQ(mgr.tier_bytes(Tier::kDevice).current, 112 * 4);
  EXPECT_THROW(mgr.finalize({0}), UsageError) << "already finalized";
}

TEST_F(ChunkManagerTest, FinalizeGivesEachGroupItsOwnExtentSoADroppedGroupIsTrimmedWhole) {
  // Two groups with one slot size, registered interleaved (as a model's master and moments are):
  // each group's first copies must fill its own reservation, so that dropping one group (the
  // optimizer state at close) leaves an extent that trim() gives back whole.
  mgr.create_group("a", DType::kFloat32, 100, Tier::kDevice);
  mgr.create_group("b", DType::kFloat32, 100, Tier::kDevice);
  std::vector<ChunkId> b_chunks;
  for (int i = 0; i < 3; ++i) {
    mgr.register_tensor("a", "a" + std::to_string(i), 100, {100});
    b_chunks.push_back(mgr.register_tensor("b", "b" + std::to_string(i), 100, {100}).chunk_id);
  }
  mgr.finalize();
  const int64_t reserved = mgr.allocator().reserved_bytes(Tier::kDevice).current;
  ASSERT_EQ(mgr.allocator().arena_extents(Tier::kDevice), 2u);
  EXPECT_EQ(mgr.trim(Tier::kDevice), 0u) << "nothing is free yet";
  for (ChunkId id : b_chunks) mgr.discard_copy(id, Tier::kDevice);
  sim.synchronize_all();
  const size_t released = mgr.trim(Tier::kDevice);
  EXPECT_EQ(released, static_cast<size_t>(reserved / 2)) << "group b's whole extent";
  EXPECT_EQ(mgr.allocator().reserved_bytes(Tier::kDevice).current, reserved / 2);
  EXPECT_EQ(mgr.allocator().arena_extents(Tier::kDevice), 1u);
}

TEST_F(ChunkManagerTest, CallerMistakesAreUsageErrors) {
  EXPECT_THROW(mgr.register_tensor("nope", "w", 4, {4}), UsageError);
  mgr.create_group("param", DType::kFloat32, 100, Tier::kDevice);
  EXPECT_THROW(mgr.create_group("param", DType::kFloat32, 100, Tier::kDevice), UsageError);
  EXPECT_THROW(mgr.create_group("pinned", DType::kFloat32, 100, Tier::kPinnedHost), UsageError)
      << "sim has no pinned tier";
  auto h = mgr.register_tensor("param", "w", 4, {4});
  EXPECT_THROW(mgr.access(h.chunk_id), UsageError) << "not finalized";
  EXPECT_THROW(mgr.finalize({7}), UsageError) << "no chunk 7 to place on the device";
  mgr.finalize();
  EXPECT_THROW(mgr.register_tensor("param", "late", 4, {4}), UsageError);
  EXPECT_THROW(mgr.chunk(99), UsageError);
  EXPECT_THROW(mgr.tensor_ptr(h, Tier::kPageableHost), UsageError);
}

struct RecordingListener : ResidencyListener {
  explicit RecordingListener(const ChunkManager& m) : mgr(m) {}
  const ChunkManager& mgr;
  std::vector<std::pair<ChunkId, bool>> events;  // (chunk, device copy present after the change)
  void on_residency_change(ChunkId id) override {
    events.emplace_back(id, mgr.chunk(id).shard_ptr(Tier::kDevice) != nullptr);
  }
};

TEST_F(ChunkManagerTest, TransferRefreshesAStaleCopyAndKeepsBoth) {
  auto hs = register_floats({40, 40}, Tier::kPageableHost);
  fill(hs, Tier::kPageableHost);
  mgr.allocate_copy(0, Tier::kDevice);
  mgr.transfer(0, Tier::kPageableHost, Tier::kDevice, /*async=*/true);
  mgr.wait(0);
  EXPECT_TRUE(mgr.chunk(0).shard_tiers().contains(Tier::kDevice));
  EXPECT_TRUE(mgr.chunk(0).shard_tiers().contains(Tier::kPageableHost)) << "a transfer keeps its source";
  expect_values(hs, Tier::kDevice);
  // Write the device copy, refresh the host copy from it.
  static_cast<float*>(mgr.tensor_ptr(hs[1], Tier::kDevice))[3] = -7.0f;
  mgr.transfer(0, Tier::kDevice, Tier::kPageableHost);
  EXPECT_EQ(static_cast<float*>(mgr.tensor_ptr(hs[1], Tier::kPageableHost))[3], -7.0f);
  EXPECT_EQ(mgr.traffic().h2d_bytes, 112 * 4);
  EXPECT_EQ(mgr.traffic().d2h_bytes, 112 * 4);
}

TEST_F(ChunkManagerTest, TheListenerHearsOfHostCopiesExchangedAndMovedAfterTheyHappened) {
  auto hs = register_floats({40}, Tier::kPageableHost);
  fill(hs, Tier::kPageableHost);
  RecordingListener listener(mgr);
  mgr.set_listener(&listener);
  struct Unset {
    ChunkManager& m;
    ~Unset() { m.set_listener(nullptr); }
  } unset{mgr};  // the manager outlives the listener on every path out of the test
  void* spare = mgr.allocate_spare(0, Tier::kPageableHost);
  void* old = mgr.exchange_copy(0, Tier::kPageableHost, spare);
  ASSERT_EQ(listener.events.size(), 1u) << "a host copy that changes address is a residency change";
  EXPECT_EQ(mgr.chunk(0).shard_ptr(Tier::kPageableHost), spare);
  mgr.release_spare(0, Tier::kPageableHost, old);
  mgr.move(0, Tier::kDevice);  // host -> device: the device copy appears, then the host copy goes
  ASSERT_EQ(listener.events.size(), 3u);
  EXPECT_EQ(listener.events[1], std::make_pair(ChunkId{0}, true));
  EXPECT_EQ(listener.events[2], std::make_pair(ChunkId{0}, true)) << "told after the host copy was dropped";
  EXPECT_EQ(mgr.chunk(0).shard_ptr(Tier::kPageableHost), nullptr);
}

TEST_F(ChunkManagerTest, DiscardDropsACopyWithoutTrafficAndTellsTheListener) {
  auto hs = register_floats({40}, Tier::kPageableHost);
  fill(hs, Tier::kPageableHost);
  RecordingListener listener(mgr);
  mgr.set_listener(&listener);
  mgr.access(0);
  ASSERT_EQ(listener.events.size(), 1u);
  EXPECT_EQ(listener.events[0], std::make_pair(ChunkId{0}, true));
  mgr.release(0);
  const int64_t d2h = mgr.traffic().d2h_bytes;
  mgr.discard_copy(0, Tier::kDevice);
  EXPECT_EQ(mgr.traffic().d2h_bytes, d2h) << "a discard copies nothing";
  EXPECT_EQ(mgr.tier_bytes(Tier::kDevice).current, 0);
  ASSERT_EQ(listener.events.size(), 2u);
  EXPECT_EQ(listener.events[1], std::make_pair(ChunkId{0}, false));
  expect_values(hs, Tier::kPageableHost);
  EXPECT_THROW(mgr.discard_copy(0, Tier::kDevice), UsageError);
  EXPECT_THROW(mgr.allocate_copy(0, Tier::kPageableHost), UsageError) << "already has a host copy";
  EXPECT_THROW(mgr.transfer(0, Tier::kDevice, Tier::kPageableHost), UsageError) << "no device copy to read";
  mgr.set_listener(nullptr);
}

TEST_F(ChunkManagerTest, DiscardOfAChunkInComputeIsABug) {
  auto hs = register_floats({40}, Tier::kPageableHost);
  fill(hs, Tier::kPageableHost);
  mgr.access(0);
  mgr.transition(hs[0], S::kCompute);
  EXPECT_THROW(mgr.discard_copy(0, Tier::kDevice), InternalError);
  mgr.transition(hs[0], S::kHold);
}

TEST_F(ChunkManagerTest, GroupsWithOneAlignmentShareTheirLayoutAcrossDtypes) {
  mgr.create_group("p16", DType::kBFloat16, 100, Tier::kDevice, 16);
  mgr.create_group("p32", DType::kFloat32, 100, Tier::kPageableHost, 16);
  for (int64_t n : {7, 33, 50, 120, 3}) {
    auto a = mgr.register_tensor("p16", "a", n, {n});
    auto b = mgr.register_tensor("p32", "b", n, {n});
    EXPECT_EQ(mgr.chunk(a.chunk_id).slot(a.slot_index).offset_numel,
              mgr.chunk(b.chunk_id).slot(b.slot_index).offset_numel);
    EXPECT_EQ(a.slot_index, b.slot_index);
  }
  mgr.finalize();
  const auto& ids16 = mgr.group("p16").chunk_ids;
  const auto& ids32 = mgr.group("p32").chunk_ids;
  ASSERT_EQ(ids16.size(), ids32.size());
  for (size_t i = 0; i < ids16.size(); ++i)
    EXPECT_EQ(mgr.chunk(ids16[i]).padded_numel(), mgr.chunk(ids32[i]).padded_numel());
}

TEST_F(ChunkManagerTest, PrefetchCopiesAheadAndAccessCountsAHit) {
  auto hs = register_floats({40, 40, 30}, Tier::kPageableHost);
  fill(hs, Tier::kPageableHost);
  mgr.prefetch(0);
  EXPECT_TRUE(mgr.in_flight(0));
  mgr.prefetch(0);  // already in flight: nothing to do
  EXPECT_EQ(mgr.traffic().prefetches, 1);
  mgr.access(0);  // compute waits for the copy; the host copy stays
  expect_values({hs[0], hs[1]}, Tier::kDevice);
  EXPECT_TRUE(mgr.chunk(0).shard_tiers().contains(Tier::kPageableHost));
  EXPECT_EQ(mgr.traffic().prefetch_hits, 1);
  EXPECT_EQ(mgr.traffic().fetches, 0) << "a prefetched chunk is not a synchronous fetch";
  mgr.release(0);
  mgr.prefetch(1);
  mgr.wait(1);
  mgr.discard_copy(1, Tier::kDevice);  // evicted before use
  EXPECT_EQ(mgr.traffic().prefetch_wasted, 1);
  mgr.access(1);
  EXPECT_EQ(mgr.traffic().fetches, 1);
  mgr.release(1);
}

TEST_F(ChunkManagerTest, PrefetchWithoutRoomChangesNothing) {
  SimBackend small{SimConfig{1024, 0, 1}};
  ChunkManager m{small, ChunkManagerConfig{1, 0, 64, true}};
  m.create_group("p", DType::kFloat32, 200, Tier::kPageableHost);
  m.register_tensor("p", "a", 200, {200});
  m.register_tensor("p", "b", 200, {200});
  m.finalize();
  m.prefetch(0);  // 832 bytes fit in 1024
  EXPECT_THROW(m.prefetch(1), OutOfMemoryError);
  EXPECT_FALSE(m.in_flight(1));
  EXPECT_FALSE(m.chunk(1).shard_tiers().contains(Tier::kDevice));
  EXPECT_EQ(m.traffic().prefetches, 1);
  m.wait(0);
}

TEST_F(ChunkManagerTest, ComputeStallsOnCopiesAreMeasured) {
  auto hs = register_floats({40, 40, 30}, Tier::kPageableHost);
  fill(hs, Tier::kPageableHost);
  mgr.access(0);  // a synchronous fetch: compute waits for the whole copy
  mgr.release(0);
  mgr.poll();
  EXPECT_EQ(mgr.traffic().copy_waits, 1);
  EXPECT_GT(mgr.traffic().copy_wait_seconds, 0.0);
  mgr.prefetch(1);
  mgr.wait(1);  // landed before compute needs it: no stall
  mgr.access(1);
  mgr.release(1);
  mgr.poll();
  EXPECT_EQ(mgr.traffic().copy_waits, 1);
}

TEST(ChunkManagerSharded, LayoutSplitsIntoShardsAndAccessNeedsACommunicator) {
  SimBackend sim(SimConfig{1 << 20, 0, 0});
  ChunkManager mgr(sim, ChunkManagerConfig{4, 1, 16, true});
  mgr.create_group("param", DType::kBFloat16, 1000, Tier::kDevice);
  mgr.register_tensor("param", "w", 900, {30, 30});
  mgr.finalize();
  const Chunk& c = mgr.chunk(0);
  EXPECT_EQ(c.shard_numel(), 256);  // ceil(1000 / 4) = 250, aligned to 8 bf16 (16 bytes) -> 256
  EXPECT_EQ(mgr.tier_bytes(Tier::kDevice).current, 256 * 2) << "a rank holds only its shard";
  EXPECT_THROW(mgr.access(0), UsageError);
}

}  // namespace
}  // namespace gx
