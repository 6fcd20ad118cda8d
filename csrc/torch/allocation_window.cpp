#include "torch/allocation_window.h"

#include "core/errors.h"

#ifdef GX_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>

#include <array>
#include <mutex>

#include "core/peak_window.h"
#include "cuda/process_allocator.h"
#include "torch/allocator_mode.h"
#endif

namespace gx::torch_layer {

#ifdef GX_WITH_CUDA
namespace {

constexpr int kMaxDevices = 64;
std::array<PeakWindow, kMaxDevices>& torch_windows() {
  static std::array<PeakWindow, kMaxDevices> windows;
  return windows;
}

void attach_tracker_once() {
  static std::once_flag attached;
  std::call_once(attached, [] {
    namespace cca = c10::cuda::CUDACachingAllocator;
    cca::attachAllocatorTraceTracker([](const cca::TraceEntry& entry) {
      if (entry.device_ < 0 || entry.device_ >= kMaxDevices) return;
      PeakWindow& w = torch_windows()[static_cast<size_t>(entry.device_)];
      if (entry.action_ == cca::TraceEntry::ALLOC) {
        w.add(static_cast<int64_t>(entry.size_));
      } else if (entry.action_ == cca::TraceEntry::FREE_REQUESTED) {
        w.add(-static_cast<int64_t>(entry.size_));
      }
    });
  });
}

void check_device(int device) {
  GX_CHECK(device >= 0 && device < kMaxDevices, "allocation window: device index expected in [0, ", kMaxDevices,
           "), got ", device, ".");
}

}  // namespace

void allocation_window_begin(int device) {
  check_device(device);
  if (chunk_allocator_installed()) return ProcessAllocator::instance().window_begin();
  attach_tracker_once();
  namespace cca = c10::cuda::CUDACachingAllocator;
  const auto stats = cca::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  // Requested sizes, as the trace reports them; index 0 is the aggregate over both pools.
  torch_windows()[static_cast<size_t>(device)].begin(stats.requested_bytes[0].current);
}

int64_t allocation_window_peak(int device) {
  check_device(device);
  if (chunk_allocator_installed()) return ProcessAllocator::instance().window_peak();
  return torch_windows()[static_cast<size_t>(device)].peak();
}

#else

void allocation_window_begin(int) {}
int64_t allocation_window_peak(int) { return 0; }

#endif

}  // namespace gx::torch_layer
