// ProcessAllocator: the CUDA allocator of the whole process under GEMINI_EXT_ALLOCATOR=chunk.
//
// Design note.
//  * What it serves. Once installed (csrc/torch/allocator_mode.*) every CUDA allocation torch
//    makes comes here; chunk slots do not (the ChunkManager's pools take them from cudaMalloc
//    directly), so what this allocator holds is exactly the process's non-model memory.
//  * Caching arena. One stream-ordered CUDA memory pool per device (cudaMemPoolCreate, release
//    threshold at the maximum so freed blocks stay cached); blocks are allocated and freed in
//    stream order (cudaMallocFromPoolAsync / cudaFreeAsync), so reuse on the same stream needs
//    no synchronisation and reuse across streams follows the pool's event dependencies.
//  * record_stream. A block used on streams other than its allocation stream is freed only
//    after those streams' work: at free, the freeing stream waits on an event recorded on each.
//  * Memory pressure. An allocation the pool cannot serve (1) synchronises the device so that
//    blocks freed on other streams become reusable and retries, (2) asks MemoryPressure's
//    reclaimers of the device (GeminiManagers evict chunks no tensor computes on and free their
//    slots) for the missing bytes and retries, (3) fails: nullptr, and the torch-facing wrapper
//    raises torch.OutOfMemoryError with the numbers. The chunk pools, conversely, release this
//    arena's cached blocks (MemoryPressure's cache releaser) before they fail.
//  * Limit. `set_memory_fraction` (torch.cuda.set_per_process_memory_fraction) caps the bytes
//    this allocator hands out plus the device bytes of chunk slots (reported by the caller) at
//    fraction x the device's memory; past it the pressure path runs as for a real failure.
//  * Statistics are exact: every allocation and free goes through one mutex-guarded table.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/peak_window.h"
#include "core/stat.h"

namespace gx {

struct ProcessAllocatorStats {
  Stat allocated_bytes;        // bytes handed out (requested sizes)
  int64_t reserved_bytes = 0;  // what the pools hold from the device now (summed over devices; read on request)
  int64_t reserved_bytes_peak = 0;  // the pools' high watermarks since the last reset_peak
  int64_t allocations = 0;
  int64_t frees = 0;
  int64_t ooms_rescued = 0;    // allocations that succeeded after a device sync or chunk eviction
  int64_t ooms_failed = 0;     // allocations that failed after everything was tried
  int64_t reclaimed_bytes = 0; // bytes the reclaimers released for this allocator
  int64_t record_streams = 0;
};

class ProcessAllocator {
 public:
  static ProcessAllocator& instance();

  void* allocate(size_t bytes, int device, cudaStream_t stream);  // nullptr when out of memory
  void free(void* ptr, size_t bytes, int device, cudaStream_t stream);
  void record_stream(void* ptr, cudaStream_t stream);
  size_t empty_cache();  // gives every pool's unused memory back; returns bytes released
  size_t release_cache(int device);
  void set_memory_fraction(double fraction, int device);
  // Device bytes held outside this allocator that the fraction limit counts (chunk slots).
  void set_external_bytes_fn(int64_t (*fn)(int device));

  ProcessAllocatorStats stats() const;
  void reset_peak();
  // The engine's per-iteration measurement of allocated bytes (core/peak_window.h): begins a
  // window at the bytes allocated now; reset_peak() and the user's peaks are left alone.
  void window_begin();
  int64_t window_peak() const { return window_.peak(); }
  size_t limit_bytes(int device) const;  // 0: none
  const char* last_error() const { return last_error_; }

 private:
  struct Block {
    size_t bytes = 0;
    int device = 0;
    cudaStream_t stream = nullptr;
    std::vector<cudaStream_t> used_on;  // record_stream
  };
  cudaMemPool_t pool_locked(int device);
  bool over_limit_locked(int device, size_t bytes) const;
  void* try_allocate(size_t bytes, int device, cudaStream_t stream);
  void read_reserved_locked(ProcessAllocatorStats& out) const;

  mutable std::mutex mutex_;
  std::unordered_map<int, cudaMemPool_t> pools_;
  std::unordered_map<void*, Block> blocks_;
  std::unordered_map<int, size_t> limit_bytes_;
  std::unordered_map<int, int64_t> in_use_by_device_;
  int64_t (*external_bytes_fn_)(int) = nullptr;
  ProcessAllocatorStats stats_;
  PeakWindow window_;
  const char* last_error_ = "";
};

}  // namespace gx

// The C entry points of torch's pluggable-allocator interface (CUDAPluggableAllocator), in
// our own _C library: usable from Python's torch.cuda.memory.CUDAPluggableAllocator too.
extern "C" {
void* gx_chunk_alloc(size_t size, int device, cudaStream_t stream);
void gx_chunk_free(void* ptr, size_t size, int device, cudaStream_t stream);
}
