// CudaBackend: the DeviceBackend seam implemented with the CUDA runtime.
//
// Design note.
//  * Memory. The device tier is cudaMalloc'd memory under a LimitingAdaptor whose limit is
//    `memory_limit_bytes` (gpu_memory_limit / GEMINI_EXT_GPU_LIMIT) or the device's total
//    memory. Host memory is page-locked at the exact size asked (no power-of-two rounding,
//    unlike PyTorch's pinned caching allocator), so a host arena of chunk slots costs what the
//    chunks need; large requests are mapped, touched in parallel and registered
//    (pinned_host_resource.h).
//  * Streams. kHostToDevice and kDeviceToHost are two non-blocking streams created here, so
//    they never synchronise implicitly with the legacy default stream; kCompute is the stream
//    the framework computes on, set by the torch layer (`set_compute_stream`), the legacy
//    default stream until then. Ordering between streams is by events only.
//  * Memory pressure. A cudaMalloc that fails first asks MemoryPressure's cache releaser (the
//    process-wide allocator's cached free blocks, GEMINI_EXT_ALLOCATOR=chunk) to give memory
//    back, and retries once.
//  * Errors. A failed cudaMalloc is an OutOfMemoryError naming the request, the free and
//    total device memory and the knob; any other CUDA error throws CudaError with the call and
//    CUDA's message.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "core/device_backend.h"
#include "core/resource_adaptors.h"
#include "cuda/pinned_host_resource.h"

namespace gx {

class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

void cuda_check(cudaError_t status, const char* call, const char* file, int line);
#define GX_CUDA_CHECK(call) ::gx::cuda_check((call), #call, __FILE__, __LINE__)

int cuda_device_count();  // 0 when there is no usable device or driver (never throws)
// Bytes held by CudaDeviceMemoryResource allocations (chunk slots) on a device, -1: all devices.
int64_t cuda_device_bytes_in_use(int device);

class CudaDeviceMemoryResource final : public MemoryResource {
 public:
  explicit CudaDeviceMemoryResource(int device) : device_(device) {}
  std::string name() const override { return "cuda_device"; }

 protected:
  void* do_allocate(size_t bytes) override;
  void do_deallocate(void* ptr, size_t bytes) override;

 private:
  int device_;
};


class CudaEvent final : public Event {
 public:
  CudaEvent(int device, cudaStream_t stream);
  ~CudaEvent() override;
  bool query() const override;
  void synchronize() override;
  double seconds_after(const Event& earlier) const override;
  cudaEvent_t raw() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

struct CudaConfig {
  int device = 0;
  size_t memory_limit_bytes = 0;  // 0: the device's total memory
};

class CudaBackend final : public DeviceBackend {
 public:
  explicit CudaBackend(CudaConfig config);
  ~CudaBackend() override;

  std::string name() const override { return "cuda"; }
  size_t device_capacity_bytes() const override { return limit_bytes_; }
  MemoryResource& device_memory() override { return *device_limited_; }
  MemoryResource& host_memory() override { return pinned_; }
  bool host_memory_is_pinned() const override { return true; }
  void* device_address_of_host(void* host_ptr) const override;

  void copy_async(void* dst, const void* src, size_t bytes, StreamKind stream) override;
  void zero_async(void* dst, size_t bytes, StreamKind stream) override;
  std::shared_ptr<Event> record_event(StreamKind stream) override;
  void stream_wait_event(StreamKind stream, const std::shared_ptr<Event>& event) override;
  void synchronize(StreamKind stream) override;

  void set_compute_stream(cudaStream_t stream) { compute_ = stream; }
  cudaStream_t stream(StreamKind kind) const;
  int device() const { return config_.device; }

 private:
  CudaConfig config_;
  size_t limit_bytes_ = 0;
  CudaDeviceMemoryResource device_raw_;
  std::unique_ptr<LimitingAdaptor> device_limited_;
  PinnedHostMemoryResource pinned_;
  cudaStream_t compute_ = nullptr;  // legacy default stream until set
  cudaStream_t h2d_ = nullptr;
  cudaStream_t d2h_ = nullptr;
};

}  // namespace gx
