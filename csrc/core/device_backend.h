// DeviceBackend: the one seam between the scheduler and a device (after mimalloc's prim.h).
//
// Design note. Everything the core needs from a device is here, implemented twice:
// `sim` (csrc/core/sim_backend.*: host memory with a byte capacity, copies on worker threads)
// and `cuda` (csrc/cuda/cuda_backend.*: cudaMalloc, pinned host memory, streams, events).
//
// Streams. Three logical streams: kCompute (where the model computes; on cuda the stream the
// framework computes on, on sim the calling thread itself), kHostToDevice and kDeviceToHost
// (side streams for chunk moves). Work on one stream runs in submission order; work on
// different streams runs concurrently unless ordered by an event.
//
// Contract, per call:
//  * copy_async(dst, src, bytes, stream): pre: both ranges valid and not overlapping, and stay
//    valid until the copy completes; post: returns at once (on kCompute of sim the copy is
//    done when it returns); the copy is ordered after all earlier work of `stream`.
//  * record_event(stream) -> Event: the event completes when all work submitted to `stream`
//    before the call has completed.
//  * stream_wait_event(stream, event): later work of `stream` starts only after `event`.
//    On sim's kCompute this blocks the calling thread until the event completes.
//  * synchronize(stream) blocks the caller until all work of `stream` is done.
//  * device_memory(): memory on the device tier; host_memory(): page-locked host memory when
//    the backend has it (cuda), plain host memory otherwise (sim). Both throw
//    OutOfMemoryError naming the request and the knob when they cannot serve.
//  * device_address_of_host(ptr): the address under which the device's kernels read and write
//    the host memory at `ptr`, or nullptr when they cannot reach it. sim: `ptr` itself (its
//    device is host memory); cuda: the mapped address of page-locked memory (over PCIe),
//    nullptr for pageable memory. Parameters whose chunk is off the device are served so.
#pragma once

#include <memory>
#include <string>

#include "memory_resource.h"

namespace gx {

enum class StreamKind : int { kCompute = 0, kHostToDevice = 1, kDeviceToHost = 2 };
constexpr int kNumStreams = 3;
const char* to_string(StreamKind stream);

class Event {
 public:
  virtual ~Event() = default;
  virtual bool query() const = 0;  // true once complete; never blocks
  virtual void synchronize() = 0;  // blocks the caller until complete
  // Seconds from `earlier`'s completion to this event's completion (negative if this one
  // completed first). Both must be complete (query() true); events of one backend only.
  virtual double seconds_after(const Event& earlier) const = 0;
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual std::string name() const = 0;              // "sim" or "cuda"
  virtual size_t device_capacity_bytes() const = 0;  // bytes the device tier may hold
  virtual MemoryResource& device_memory() = 0;
  virtual MemoryResource& host_memory() = 0;
  virtual bool host_memory_is_pinned() const = 0;
  virtual void* device_address_of_host(void* host_ptr) const = 0;

  virtual void copy_async(void* dst, const void* src, size_t bytes, StreamKind stream) = 0;
  // Zeroes `bytes` of device memory at `dst`, in `stream`'s order (no host buffer involved).
  virtual void zero_async(void* dst, size_t bytes, StreamKind stream) = 0;
  virtual std::shared_ptr<Event> record_event(StreamKind stream) = 0;
  virtual void stream_wait_event(StreamKind stream, const std::shared_ptr<Event>& event) = 0;
  virtual void synchronize(StreamKind stream) = 0;
  void synchronize_all() {
    for (int s = 0; s < kNumStreams; ++s) synchronize(static_cast<StreamKind>(s));
  }
};

}  // namespace gx
