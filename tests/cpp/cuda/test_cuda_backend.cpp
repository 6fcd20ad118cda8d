// The cuda backend under the shared conformance suites, plus the ChunkManager on a real GPU.
// Every test skips itself on a machine without a CUDA device (CI compiles and runs this binary
// there; a GPU machine runs it for real: see docs/TESTING.md).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>

#include "common/backend_conformance.h"
#include "common/resource_conformance.h"
#include "core/chunk_manager.h"
#include "cuda/cuda_backend.h"

namespace gx {
namespace {

using testing::BackendConformance;
using testing::BackendFactory;
using testing::ResourceConformance;
using testing::ResourceFactory;

bool have_gpu() { return cuda_device_count() > 0; }

#define SKIP_WITHOUT_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device"

INSTANTIATE_TEST_SUITE_P(
    Cuda, BackendConformance,
    ::testing::Values(BackendFactory{"cuda", []() -> std::unique_ptr<DeviceBackend> {
                        if (!have_gpu()) return nullptr;
                        return std::make_unique<CudaBackend>(CudaConfig{0, 0});
                      }},
                      BackendFactory{"cuda_limited_256MiB", []() -> std::unique_ptr<DeviceBackend> {
                        if (!have_gpu()) return nullptr;
                        return std::make_unique<CudaBackend>(CudaConfig{0, size_t{256} << 20});
                      }}),
    [](const auto& info) { return info.param.name; });

MemoryResource* make_pinned(std::vector<std::shared_ptr<void>>& keep) {
  if (!have_gpu()) return nullptr;
  auto r = std::make_shared<PinnedHostMemoryResource>();
  keep.push_back(r);
  return r.get();
}

INSTANTIATE_TEST_SUITE_P(Cuda, ResourceConformance,
                         ::testing::Values(ResourceFactory{"cuda_device",
                                                           [](auto& keep) -> MemoryResource* {
                                                             if (!have_gpu()) return nullptr;
                                                             auto r = std::make_shared<CudaDeviceMemoryResource>(0);
                                                             keep.push_back(r);
                                                             return r.get();
                                                           },
                                                           1 << 20},
                                           ResourceFactory{"pinned_host", make_pinned, 1 << 20, true},
                                           // requests this large take the mapped + registered path
                                           ResourceFactory{"pinned_host_mapped", make_pinned,
                                                           PinnedHostMemoryResource::kRegisterMinBytes, true}),
                         [](const auto& info) { return info.param.name; });

TEST(CudaChunkManager, MovesBetweenGpuAndPinnedHostPreserveBytes) {
  SKIP_WITHOUT_GPU();
  CudaBackend cuda(CudaConfig{0, 0});
  ChunkManager mgr(cuda, ChunkManagerConfig{1, 0, 64, true});
  EXPECT_EQ(mgr.host_tier(), Tier::kPinnedHost);
  mgr.create_group("param", DType::kFloat32, 1 << 20, Tier::kPinnedHost);
  std::vector<TensorHandle> hs;
  for (int i = 0; i < 10; ++i) hs.push_back(mgr.register_tensor("param", "w" + std::to_string(i), 300000, {300000}));
  mgr.finalize();
  for (size_t i = 0; i < hs.size(); ++i) {
    auto* p = static_cast<float*>(mgr.tensor_ptr(hs[i], Tier::kPinnedHost));
    for (int k = 0; k < 300000; ++k) p[k] = static_cast<float>(i) + k * 0.5f;
    mgr.transition(hs[i], TensorState::kHold);
  }
  const size_t chunks = mgr.num_chunks();
  for (int round = 0; round < 5; ++round) {
    for (ChunkId c = 0; c < static_cast<ChunkId>(chunks); ++c) mgr.move(c, Tier::kDevice, /*async=*/true);
    for (ChunkId c = 0; c < static_cast<ChunkId>(chunks); ++c) mgr.move(c, Tier::kPinnedHost, /*async=*/true);
  }
  for (ChunkId c = 0; c < static_cast<ChunkId>(chunks); ++c) mgr.wait(c);
  for (size_t i = 0; i < hs.size(); ++i) {
    auto* p = static_cast<float*>(mgr.tensor_ptr(hs[i], Tier::kPinnedHost));
    for (int k = 0; k < 300000; k += 997) ASSERT_EQ(p[k], static_cast<float>(i) + k * 0.5f);
  }
  EXPECT_EQ(mgr.tier_bytes(Tier::kDevice).current, 0);
  EXPECT_EQ(mgr.traffic().h2d_bytes, mgr.traffic().d2h_bytes);
  EXPECT_EQ(mgr.allocator().upstream_allocations(Tier::kDevice), chunks) << "device slots reused across rounds";
}

TEST(CudaChunkManager, AccessFetchesAndComputeStreamSeesTheBytes) {
  SKIP_WITHOUT_GPU();
  CudaBackend cuda(CudaConfig{0, 0});
  ChunkManager mgr(cuda, ChunkManagerConfig{1, 0, 64, true});
  mgr.create_group("param", DType::kFloat32, 1 << 16, Tier::kPinnedHost);
  auto h = mgr.register_tensor("param", "w", 1 << 16, {1 << 16});
  mgr.finalize();
  auto* host = static_cast<float*>(mgr.tensor_ptr(h, Tier::kPinnedHost));
  for (int k = 0; k < (1 << 16); ++k) host[k] = static_cast<float>(k);
  mgr.transition(h, TensorState::kHold);
  mgr.transition(h, TensorState::kCompute);
  mgr.access(h.chunk_id);
  std::vector<float> back(1 << 16, -1.0f);
  cuda.copy_async(back.data(), mgr.gathered_tensor_ptr(h), back.size() * sizeof(float), StreamKind::kCompute);
  cuda.synchronize(StreamKind::kCompute);
  for (int k = 0; k < (1 << 16); k += 101) ASSERT_EQ(back[k], static_cast<float>(k));
  mgr.transition(h, TensorState::kHold);
  mgr.release(h.chunk_id);
}

TEST(PinnedHost, LargeRequestsAreMappedTouchedAndRegistered) {
  SKIP_WITHOUT_GPU();
  PinnedHostMemoryResource pinned;
  const size_t bytes = PinnedHostMemoryResource::kRegisterMinBytes + 4096;
  auto* host = static_cast<uint8_t*>(pinned.allocate(bytes));
  EXPECT_EQ(pinned.registered_ranges(), 1u);
  cudaPointerAttributes attributes{};
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, host), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeHost) << "page-locked, known to CUDA";
  for (size_t b = 0; b < bytes; b += 1 << 20) ASSERT_EQ(host[b], 0) << "fresh mapped pages read as zero, byte " << b;
  ASSERT_EQ(host[bytes - 1], 0);
  for (size_t b = 0; b < bytes; b += 4099) host[b] = static_cast<uint8_t>(b * 7);
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  std::memset(host, 0xff, bytes);
  ASSERT_EQ(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(device);
  for (size_t b = 0; b < bytes; b += 4099) ASSERT_EQ(host[b], static_cast<uint8_t>(b * 7)) << "byte " << b;
  pinned.deallocate(host, bytes);
  EXPECT_EQ(pinned.registered_ranges(), 0u);
}

TEST(PinnedHost, SmallRequestsUseCudaHostAlloc) {
  SKIP_WITHOUT_GPU();
  PinnedHostMemoryResource pinned;
  void* p = pinned.allocate(1 << 20);
  EXPECT_EQ(pinned.registered_ranges(), 0u);
  cudaPointerAttributes attributes{};
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, p), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeHost);
  pinned.deallocate(p, 1 << 20);
}

TEST(PinnedHost, HostAvailableBytesReadsMemAvailable) {  // no GPU needed
  const int64_t available = host_available_bytes();
  ASSERT_GT(available, 0);
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  EXPECT_LE(available, static_cast<int64_t>(pages) * page) << "available cannot exceed physical memory";
  std::ifstream meminfo("/proc/meminfo");  // the test may use iostreams; the extension may not
  std::string key, unit;
  int64_t kib = -1;
  while (meminfo >> key >> kib && key != "MemAvailable:") std::getline(meminfo, unit);
  ASSERT_EQ(key, "MemAvailable:");
  EXPECT_NEAR(static_cast<double>(available), static_cast<double>(kib) * 1024, double(size_t{256} << 20))
      << "the same field, read twice a moment apart";
}

TEST(PinnedHost, ARequestAboveWhatTheHostHasIsRefusedBeforeTouchingIt) {
  SKIP_WITHOUT_GPU();
  const int64_t available = host_available_bytes();
  ASSERT_GT(available, 0) << "/proc/meminfo has MemAvailable on Linux";
  PinnedHostMemoryResource pinned;
  try {
    pinned.allocate(static_cast<size_t>(available) + (size_t{1} << 30));
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("MemAvailable"), std::string::npos) << e.what();
  }
  EXPECT_EQ(pinned.registered_ranges(), 0u);
}

TEST(CudaBackend, LimitAboveTheDeviceIsRefused) {
  SKIP_WITHOUT_GPU();
  EXPECT_THROW(CudaBackend(CudaConfig{0, size_t{1} << 50}), UsageError);
  EXPECT_THROW(CudaBackend(CudaConfig{99, 0}), UsageError);
}

}  // namespace
}  // namespace gx

#undef SKIP_WITHOUT_GPU  // a unity build compiles the next test file in this unit
