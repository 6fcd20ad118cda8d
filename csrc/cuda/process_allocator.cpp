#include "cuda/process_allocator.h"

#include <limits>

#include "core/errors.h"
#include "core/memory_pressure.h"
#include "cuda/cuda_backend.h"

namespace gx {

ProcessAllocator& ProcessAllocator::instance() {
  static ProcessAllocator* allocator = new ProcessAllocator();  // lives until exit: torch frees late
  return *allocator;
}

cudaMemPool_t ProcessAllocator::pool_locked(int device) {
  auto it = pools_.find(device);
  if (it != pools_.end()) return it->second;
  cudaMemPoolProps props = {};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool = nullptr;
  GX_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
  uint64_t keep = std::numeric_limits<uint64_t>::max();  // cache freed blocks; trimmed on demand
  GX_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  pools_.emplace(device, pool);
  return pool;
}

bool ProcessAllocator::over_limit_locked(int device, size_t bytes) const {
  auto it = limit_bytes_.find(device);
  if (it == limit_bytes_.end() || it->second == 0) return false;
  auto used = in_use_by_device_.find(device);
  int64_t total = (used == in_use_by_device_.end() ? 0 : used->second) + static_cast<int64_t>(bytes);
  if (external_bytes_fn_ != nullptr) total += external_bytes_fn_(device);
  return total > static_cast<int64_t>(it->second);
}

void ProcessAllocator::read_reserved_locked(ProcessAllocatorStats& out) const {
  // The pools keep their own figures (current and high watermark): read them when asked rather
  // than on every allocation.
  int64_t current = 0, high = 0;
  for (const auto& [device, pool] : pools_) {
    uint64_t c = 0, h = 0;
    if (cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &c) == cudaSuccess)
      current += static_cast<int64_t>(c);
    if (cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &h) == cudaSuccess)
      high += static_cast<int64_t>(h);
  }
  out.reserved_bytes = current;
  out.reserved_bytes_peak = high;
}

void* ProcessAllocator::try_allocate(size_t bytes, int device, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (over_limit_locked(device, bytes)) {
    last_error_ = "the memory fraction limit";
    return nullptr;
  }
  void* ptr = nullptr;
  const cudaError_t status = cudaMallocFromPoolAsync(&ptr, bytes, pool_locked(device), stream);
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    last_error_ = "the device's memory";
    return nullptr;
  }
  GX_CUDA_CHECK(status);
  blocks_.emplace(ptr, Block{bytes, device, stream, {}});
  in_use_by_device_[device] += static_cast<int64_t>(bytes);
  stats_.allocated_bytes.increase(static_cast<int64_t>(bytes));
  window_.add(static_cast<int64_t>(bytes));
  stats_.allocations += 1;
  return ptr;
}

void* ProcessAllocator::allocate(size_t bytes, int device, cudaStream_t stream) {
  if (bytes == 0) return nullptr;
  if (void* p = try_allocate(bytes, device, stream)) return p;
  // (1) blocks freed on other streams become reusable once their work is done
  GX_CUDA_CHECK(cudaDeviceSynchronize());
  if (void* p = try_allocate(bytes, device, stream)) {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.ooms_rescued += 1;
    return p;
  }
  // (2) evict chunks that no tensor computes on (MemoryPressure's reclaimers: GeminiManagers)
  const size_t released = MemoryPressure::instance().reclaim(device, bytes);
  if (released > 0) {
    void* p = try_allocate(bytes, device, stream);
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.reclaimed_bytes += static_cast<int64_t>(released);
    if (p != nullptr) {
      stats_.ooms_rescued += 1;
      return p;
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.ooms_failed += 1;
  return nullptr;
}

void ProcessAllocator::free(void* ptr, size_t /*bytes*/, int /*device*/, cudaStream_t stream) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = blocks_.find(ptr);
  GX_INTERNAL_ASSERT(it != blocks_.end(), "ProcessAllocator: free of a pointer it did not allocate");
  Block block = std::move(it->second);
  blocks_.erase(it);
  // Streams the block was also used on finish with it before the pool may hand it out again.
  for (cudaStream_t other : block.used_on) {
    cudaEvent_t event = nullptr;
    GX_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    GX_CUDA_CHECK(cudaEventRecord(event, other));
    GX_CUDA_CHECK(cudaStreamWaitEvent(block.stream, event, 0));
    GX_CUDA_CHECK(cudaEventDestroy(event));
  }
  (void)stream;  // freed on the allocation stream: the stream the block's lifetime is ordered on
  GX_CUDA_CHECK(cudaFreeAsync(ptr, block.stream));
  in_use_by_device_[block.device] -= static_cast<int64_t>(block.bytes);
  stats_.allocated_bytes.decrease(static_cast<int64_t>(block.bytes));
  window_.add(-static_cast<int64_t>(block.bytes));
  stats_.frees += 1;
}

void ProcessAllocator::record_stream(void* ptr, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = blocks_.find(ptr);
  if (it == blocks_.end() || it->second.stream == stream) return;
  for (cudaStream_t s : it->second.used_on)
    if (s == stream) return;
  it->second.used_on.push_back(stream);
  stats_.record_streams += 1;
}

size_t ProcessAllocator::release_cache(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = pools_.find(device);
  if (it == pools_.end()) return 0;
  GX_CUDA_CHECK(cudaDeviceSynchronize());  // frees in flight complete, so their memory can go
  uint64_t before = 0, after = 0;
  cudaMemPoolGetAttribute(it->second, cudaMemPoolAttrReservedMemCurrent, &before);
  GX_CUDA_CHECK(cudaMemPoolTrimTo(it->second, 0));
  cudaMemPoolGetAttribute(it->second, cudaMemPoolAttrReservedMemCurrent, &after);
  return static_cast<size_t>(before - after);
}

size_t ProcessAllocator::empty_cache() {
  std::vector<int> devices;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [device, pool] : pools_) devices.push_back(device);
  }
  size_t released = 0;
  for (int d : devices) released += release_cache(d);
  return released;
}

void ProcessAllocator::set_memory_fraction(double fraction, int device) {
  GX_CHECK(fraction > 0.0 && fraction <= 1.0, "memory fraction: expected in (0, 1], got ", fraction, ".");
  size_t free_bytes = 0, total_bytes = 0;
  int previous = 0;
  GX_CUDA_CHECK(cudaGetDevice(&previous));
  GX_CUDA_CHECK(cudaSetDevice(device));
  GX_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  GX_CUDA_CHECK(cudaSetDevice(previous));
  std::lock_guard<std::mutex> lock(mutex_);
  limit_bytes_[device] = static_cast<size_t>(fraction * static_cast<double>(total_bytes));
}

void ProcessAllocator::set_external_bytes_fn(int64_t (*fn)(int)) {
  std::lock_guard<std::mutex> lock(mutex_);
  external_bytes_fn_ = fn;
}

ProcessAllocatorStats ProcessAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ProcessAllocatorStats out = stats_;
  read_reserved_locked(out);
  return out;
}

void ProcessAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.allocated_bytes.reset_peak();
  for (const auto& [device, pool] : pools_) {
    uint64_t zero = 0;  // the pool's high watermark restarts from its current reservation
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero);
  }
}

void ProcessAllocator::window_begin() {
  std::lock_guard<std::mutex> lock(mutex_);
  window_.begin(stats_.allocated_bytes.current);
}

size_t ProcessAllocator::limit_bytes(int device) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = limit_bytes_.find(device);
  return it == limit_bytes_.end() ? 0 : it->second;
}

}  // namespace gx

extern "C" {
void* gx_chunk_alloc(size_t size, int device, cudaStream_t stream) {
  try {
    return gx::ProcessAllocator::instance().allocate(size, device, stream);
  } catch (...) {
    return nullptr;  // a C caller cannot take exceptions
  }
}

void gx_chunk_free(void* ptr, size_t size, int device, cudaStream_t stream) {
  try {
    gx::ProcessAllocator::instance().free(ptr, size, device, stream);
  } catch (...) {
  }
}
}
