// Page-locked host memory: cudaHostAlloc against PinnedHostMemoryResource's mapped path (mmap,
// huge-page advice, first touch on several threads, cudaHostRegister), allocation and freeing
// timed separately, at sizes a chunk group's reservation reaches for large models.
//
//   cmake -S csrc -B build/cpp -G Ninja && cmake --build build/cpp --target gx_pinned_bench
//   ./build/cpp/gx_pinned_bench [GiB ...]        (default: 1 4 16)
//
// Prints a markdown table. The first CUDA call is made before any timing (context creation).
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "cuda/cuda_backend.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Timing {
  double allocate_s = 0, free_s = 0;
};

Timing time_cuda_host_alloc(size_t bytes) {
  Timing t;
  void* p = nullptr;
  auto t0 = std::chrono::steady_clock::now();
  if (cudaHostAlloc(&p, bytes, cudaHostAllocDefault) != cudaSuccess) {
    std::fprintf(stderr, "cudaHostAlloc of %zu bytes failed\n", bytes);
    std::exit(1);
  }
  t.allocate_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  cudaFreeHost(p);
  t.free_s = seconds_since(t0);
  return t;
}

Timing time_resource(gx::PinnedHostMemoryResource& pinned, size_t bytes) {
  Timing t;
  auto t0 = std::chrono::steady_clock::now();
  void* p = pinned.allocate(bytes);
  t.allocate_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  pinned.deallocate(p, bytes);
  t.free_s = seconds_since(t0);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<double> gib;
  for (int i = 1; i < argc; ++i) gib.push_back(std::atof(argv[i]));
  if (gib.empty()) gib = {1, 4, 16};
  if (gx::cuda_device_count() == 0) {
    std::fprintf(stderr, "gx_pinned_bench: no CUDA device\n");
    return 1;
  }
  cudaFree(nullptr);  // create the context outside the timings
  gx::PinnedHostMemoryResource pinned;
  std::printf("threads for the first touch: %d (GEMINI_EXT_CPU_THREADS or the hardware's count)\n\n",
              gx::ThreadPool::default_threads());
  std::printf("| GiB | path | allocate s | GB/s | free s |\n|---|---|---|---|---|\n");
  for (double g : gib) {
    const size_t bytes = static_cast<size_t>(g * (1ull << 30));
    const Timing a = time_cuda_host_alloc(bytes);
    std::printf("| %.1f | cudaHostAlloc | %.2f | %.1f | %.2f |\n", g, a.allocate_s, bytes / a.allocate_s / 1e9,
                a.free_s);
    const Timing b = time_resource(pinned, bytes);
    std::printf("| %.1f | %s | %.2f | %.1f | %.2f |\n", g,
                bytes >= gx::PinnedHostMemoryResource::kRegisterMinBytes ? "mapped + cudaHostRegister"
                                                                         : "cudaHostAlloc (resource)",
                b.allocate_s, bytes / b.allocate_s / 1e9, b.free_s);
    std::fflush(stdout);
  }
  return 0;
}
