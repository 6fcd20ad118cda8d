// PinnedHostMemoryResource: page-locked host memory, the host tier of the cuda backend.
//
// Design note.
//  * Why two paths. cudaHostAlloc faults in and pins every page of a request from the calling
//    thread. The host tier asks for one reservation per chunk group (bytes of every chunk of the
//    group whose first copy is on the host), tens of GB for a model that fills the host, where
//    pinning from one thread takes minutes (over 100 s for 117 GB). A request of at
//    least kRegisterMinBytes is therefore mapped anonymously (mmap), advised to use transparent
//    huge pages (512 times fewer faults where the kernel allows them), faulted in by several
//    threads at once (one write per page), then page-locked with cudaHostRegister, which then
//    walks resident pages only.
//    PyTorch's pinned allocator offers the same idea behind `pinned_use_cuda_host_register`.
//    Smaller requests (slots created after enable(), spares) keep cudaHostAlloc.
//  * Contents. Memory of the mapped path reads as zero (fresh anonymous pages); the cudaHostAlloc
//    path makes no promise. Callers that need zeros write them (ChunkManager::finalize does).
//  * Out of memory. A mapped request larger than the host's MemAvailable is refused with an
//    OutOfMemoryError before any page is touched: touching it would invoke the kernel's
//    out-of-memory killer, which ends the process without an exception. mmap or cudaHostRegister
//    failing for lack of memory is an OutOfMemoryError as well; cudaHostRegister failing for any
//    other reason (a system that does not support it) falls back to cudaHostAlloc.
//  * Forks. Both paths' pages are marked MADV_DONTFORK (core/host_pages.h): a forked child
//    (a DataLoader worker) does not share them, so the parent's writes copy nothing.
//  * Freeing. Registered ranges are remembered (pointer to length): cudaHostUnregister and munmap;
//    everything else cudaFreeHost.
//  * Threads. The first touch uses its own short-lived threads (GEMINI_EXT_CPU_THREADS or the
//    hardware's count, at most one per 64 MiB), never the global ThreadPool: an allocation may
//    happen while the optimizer thread holds that pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "core/memory_resource.h"

namespace gx {

class PinnedHostMemoryResource final : public MemoryResource {
 public:
  static constexpr size_t kRegisterMinBytes = size_t{256} << 20;

  std::string name() const override { return "pinned_host"; }
  // Ranges currently page-locked through the mapped path (tests, statistics).
  size_t registered_ranges() const;

 protected:
  void* do_allocate(size_t bytes) override;
  void do_deallocate(void* ptr, size_t bytes) override;

 private:
  // nullptr when cudaHostRegister is not supported here (the caller falls back).
  void* map_touch_and_register(size_t bytes);

  mutable std::mutex mutex_;
  std::unordered_map<void*, size_t> registered_;  // pointer -> mapped length
};

// Bytes the kernel reports as available for new allocations (/proc/meminfo MemAvailable);
// -1 when unknown.
int64_t host_available_bytes();

}  // namespace gx
