#include "cuda/cuda_backend.h"

#include <array>
#include <atomic>

#include "core/errors.h"
#include "core/memory_pressure.h"

namespace gx {

namespace {
// Makes `device` current for the scope, restoring the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    GX_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) GX_CUDA_CHECK(cudaSetDevice(device));
    changed_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool changed_ = false;
};
}  // namespace

void cuda_check(cudaError_t status, const char* call, const char* file, int line) {
  if (status == cudaSuccess) return;
  throw CudaError(detail::concat("CUDA error in ", call, " (", file, ":", line, "): ", cudaGetErrorName(status), ": ",
                                 cudaGetErrorString(status)));
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls are not confused
    return 0;
  }
  return count;
}

namespace {
constexpr int kMaxDevices = 64;
std::array<std::atomic<int64_t>, kMaxDevices> g_device_bytes{};
void count_device_bytes(int device, int64_t delta) {
  if (device >= 0 && device < kMaxDevices) g_device_bytes[static_cast<size_t>(device)] += delta;
}
}  // namespace

int64_t cuda_device_bytes_in_use(int device) {
  if (device >= 0) return device < kMaxDevices ? g_device_bytes[static_cast<size_t>(device)].load() : 0;
  int64_t total = 0;
  for (const auto& b : g_device_bytes) total += b.load();
  return total;
}

void* CudaDeviceMemoryResource::do_allocate(size_t bytes) {
  DeviceGuard guard(device_);
  void* ptr = nullptr;
  cudaError_t status = cudaMalloc(&ptr, bytes);
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    if (MemoryPressure::instance().release_caches(device_) > 0) status = cudaMalloc(&ptr, bytes);
  }
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    throw OutOfMemoryError(detail::concat("cuda_device out of memory: tried to allocate ", bytes, " bytes on device ",
                                          device_, " with ", free_bytes, " bytes free of ", total_bytes,
                                          ". Lower gpu_memory_limit / the device-resident fraction, or free memory."));
  }
  GX_CUDA_CHECK(status);
  count_device_bytes(device_, static_cast<int64_t>(bytes));
  return ptr;
}

void CudaDeviceMemoryResource::do_deallocate(void* ptr, size_t bytes) {
  DeviceGuard guard(device_);
  GX_CUDA_CHECK(cudaFree(ptr));
  count_device_bytes(device_, -static_cast<int64_t>(bytes));
}

CudaEvent::CudaEvent(int device, cudaStream_t stream) {
  DeviceGuard guard(device);
  // Timing enabled: the manager measures how long compute waited for a copy (seconds_after).
  GX_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDefault));
  GX_CUDA_CHECK(cudaEventRecord(event_, stream));
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

bool CudaEvent::query() const {
  const cudaError_t status = cudaEventQuery(event_);
  if (status == cudaErrorNotReady) return false;
  GX_CUDA_CHECK(status);
  return true;
}

void CudaEvent::synchronize() { GX_CUDA_CHECK(cudaEventSynchronize(event_)); }

double CudaEvent::seconds_after(const Event& earlier) const {
  const auto* other = dynamic_cast<const CudaEvent*>(&earlier);
  GX_INTERNAL_ASSERT(other != nullptr, "seconds_after between events of different backends");
  float ms = 0.0f;
  GX_CUDA_CHECK(cudaEventElapsedTime(&ms, other->event_, event_));
  return static_cast<double>(ms) / 1e3;
}

CudaBackend::CudaBackend(CudaConfig config) : config_(config), device_raw_(config.device) {
  const int count = cuda_device_count();
  GX_CHECK(config.device >= 0 && config.device < count, "cuda device: expected an index in [0, ", count,
           "), got ", config.device, ". Use device='sim' on a machine without a GPU.");
  DeviceGuard guard(config.device);
  size_t free_bytes = 0, total_bytes = 0;
  GX_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  GX_CHECK(config.memory_limit_bytes <= total_bytes, "gpu_memory_limit: expected at most the device's ", total_bytes,
           " bytes, got ", config.memory_limit_bytes, ". Lower the limit.");
  limit_bytes_ = config.memory_limit_bytes == 0 ? total_bytes : config.memory_limit_bytes;
  device_limited_ = std::make_unique<LimitingAdaptor>(device_raw_, limit_bytes_, "gpu_memory_limit");
  GX_CUDA_CHECK(cudaStreamCreateWithFlags(&h2d_, cudaStreamNonBlocking));
  GX_CUDA_CHECK(cudaStreamCreateWithFlags(&d2h_, cudaStreamNonBlocking));
}

CudaBackend::~CudaBackend() {
  cudaStreamSynchronize(h2d_);
  cudaStreamSynchronize(d2h_);
  cudaStreamDestroy(h2d_);
  cudaStreamDestroy(d2h_);
}

cudaStream_t CudaBackend::stream(StreamKind kind) const {
  switch (kind) {
    case StreamKind::kCompute: return compute_;
    case StreamKind::kHostToDevice: return h2d_;
    case StreamKind::kDeviceToHost: return d2h_;
  }
  GX_INTERNAL_ASSERT(false, "unknown stream kind");
}

void CudaBackend::copy_async(void* dst, const void* src, size_t bytes, StreamKind kind) {
  DeviceGuard guard(config_.device);
  GX_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream(kind)));
}

void* CudaBackend::device_address_of_host(void* host_ptr) const {
  if (host_ptr == nullptr) return nullptr;
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, host_ptr) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state of a failed query
    return nullptr;
  }
  // Page-locked memory registered or allocated under unified addressing is mapped; pageable
  // memory (cudaMemoryTypeUnregistered) is not reachable from kernels.
  if (attributes.type != cudaMemoryTypeHost) return nullptr;
  return attributes.devicePointer;
}

void CudaBackend::zero_async(void* dst, size_t bytes, StreamKind kind) {
  DeviceGuard guard(config_.device);
  GX_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream(kind)));
}

std::shared_ptr<Event> CudaBackend::record_event(StreamKind kind) {
  return std::make_shared<CudaEvent>(config_.device, stream(kind));
}

void CudaBackend::stream_wait_event(StreamKind kind, const std::shared_ptr<Event>& event) {
  auto* cuda_event = dynamic_cast<CudaEvent*>(event.get());
  GX_INTERNAL_ASSERT(cuda_event != nullptr, "stream_wait_event on the cuda backend with a non-CUDA event");
  DeviceGuard guard(config_.device);
  GX_CUDA_CHECK(cudaStreamWaitEvent(stream(kind), cuda_event->raw(), 0));
}

void CudaBackend::synchronize(StreamKind kind) {
  DeviceGuard guard(config_.device);
  GX_CUDA_CHECK(cudaStreamSynchronize(stream(kind)));
}

}  // namespace gx
