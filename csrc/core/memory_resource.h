// MemoryResource: the narrow allocate/deallocate interface every tier's memory goes through.
//
// Design note (after RMM's device_memory_resource). A resource owns memory; an adaptor wraps
// an upstream resource and adds one behaviour (statistics, a byte limit); the chunk pool is a
// resource of fixed-size slots over an upstream. Preconditions: `bytes > 0`; `deallocate`
// gets exactly the pointer and size `allocate` returned. Postconditions: `allocate` returns a
// pointer aligned to at least kResourceAlignmentBytes or throws OutOfMemoryError naming the
// size; it never returns nullptr. Resources are not copyable; they must outlive their users.
#pragma once

#include <cstddef>
#include <string>

namespace gx {

constexpr size_t kResourceAlignmentBytes = 256;  // bytes; matches cudaMalloc's guarantee

class MemoryResource {
 public:
  virtual ~MemoryResource() = default;
  MemoryResource() = default;
  MemoryResource(const MemoryResource&) = delete;
  MemoryResource& operator=(const MemoryResource&) = delete;

  void* allocate(size_t bytes) { return do_allocate(bytes); }
  void deallocate(void* ptr, size_t bytes) { do_deallocate(ptr, bytes); }
  // A short human name ("host", "sim_device", "cuda_device", "pinned_host").
  virtual std::string name() const = 0;

 protected:
  virtual void* do_allocate(size_t bytes) = 0;
  virtual void do_deallocate(void* ptr, size_t bytes) = 0;
};

// Pageable host memory: whole anonymous pages kept out of forked children (host_pages.h).
class HostMemoryResource final : public MemoryResource {
 public:
  std::string name() const override { return "host"; }

 protected:
  void* do_allocate(size_t bytes) override;
  void do_deallocate(void* ptr, size_t bytes) override;
};

}  // namespace gx
