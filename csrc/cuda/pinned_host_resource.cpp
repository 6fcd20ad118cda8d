#include "cuda/pinned_host_resource.h"

#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "core/errors.h"
#include "core/host_pages.h"
#include "core/thread_pool.h"
#include "cuda/cuda_backend.h"

namespace gx {

namespace {

constexpr size_t kTouchGrainBytes = size_t{64} << 20;

// Faults in [base, base + bytes) from several threads, one write per page: the kernel's per-page
// work (allocate, zero, map) runs in parallel, and the pages read as zero. Filling them is left to
// the caller (ChunkManager::finalize zeroes every first copy on every core anyway).
void touch_in_parallel(uint8_t* base, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t pieces = (bytes + kTouchGrainBytes - 1) / kTouchGrainBytes;
  const size_t threads = std::min<size_t>(static_cast<size_t>(ThreadPool::default_threads()), pieces);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next.fetch_add(1); i < pieces; i = next.fetch_add(1)) {
      const size_t end = std::min(bytes, (i + 1) * kTouchGrainBytes);
      for (size_t b = i * kTouchGrainBytes; b < end; b += page) static_cast<volatile uint8_t*>(base)[b] = 0;
    }
  };
  std::vector<std::thread> helpers;
  helpers.reserve(threads > 0 ? threads - 1 : 0);
  for (size_t t = 1; t < threads; ++t) helpers.emplace_back(work);
  work();
  for (auto& h : helpers) h.join();
}

}  // namespace

int64_t host_available_bytes() {
  // POSIX reads and strtoll, not std::ifstream: integer extraction through an istream has
  // crashed inside the extension (torch 2.11 CUDA builds), as ostream formatting has
  // (core/errors.h).
  const int fd = open("/proc/meminfo", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char text[8192];
  size_t length = 0;
  for (ssize_t n; length < sizeof(text) - 1 && (n = read(fd, text + length, sizeof(text) - 1 - length)) != 0;) {
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    length += static_cast<size_t>(n);
  }
  close(fd);
  text[length] = '\0';
  constexpr char kKey[] = "MemAvailable:";
  const char* line = std::strstr(text, kKey);
  if (line == nullptr) return -1;
  char* end = nullptr;
  const long long kib = std::strtoll(line + sizeof(kKey) - 1, &end, 10);  // reported in kB
  if (end == line + sizeof(kKey) - 1 || kib < 0) return -1;
  return static_cast<int64_t>(kib) * 1024;
}

size_t PinnedHostMemoryResource::registered_ranges() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return registered_.size();
}

void* PinnedHostMemoryResource::map_touch_and_register(size_t bytes) {
  const int64_t available = host_available_bytes();
  if (available >= 0 && bytes > static_cast<size_t>(available)) {
    throw OutOfMemoryError(detail::concat("pinned_host out of memory: ", bytes, " bytes asked, the host has ",
                                          available,
                                          " bytes available (MemAvailable). Free host memory, lower the offloaded "
                                          "fraction or use more ranks."));
  }
  void* ptr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (ptr == MAP_FAILED) {
    const int err = errno;
    throw OutOfMemoryError(detail::concat("pinned_host out of memory: mmap of ", bytes, " bytes failed (",
                                          std::strerror(err), "). Free host memory or lower the offloaded fraction."));
  }
  madvise(ptr, bytes, MADV_HUGEPAGE);  // advice only: ignored where transparent huge pages are off
  keep_out_of_forks(ptr, bytes);       // before the first touch: a fork never shares these pages
  try {
    touch_in_parallel(static_cast<uint8_t*>(ptr), bytes);
  } catch (...) {
    munmap(ptr, bytes);
    throw;
  }
  const cudaError_t status = cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
  if (status != cudaSuccess) {
    cudaGetLastError();
    munmap(ptr, bytes);
    if (status == cudaErrorMemoryAllocation) {
      throw OutOfMemoryError(detail::concat("pinned_host out of memory: cudaHostRegister of ", bytes, " bytes failed (",
                                            cudaGetErrorString(status), "). Free host memory, lower the offloaded "
                                            "fraction or set pin_memory=False."));
    }
    return nullptr;  // not supported here: cudaHostAlloc instead
  }
  std::lock_guard<std::mutex> lock(mutex_);
  registered_.emplace(ptr, bytes);
  return ptr;
}

void* PinnedHostMemoryResource::do_allocate(size_t bytes) {
  if (bytes >= kRegisterMinBytes) {
    if (void* ptr = map_touch_and_register(bytes)) return ptr;
  }
  void* ptr = nullptr;
  const cudaError_t status = cudaHostAlloc(&ptr, bytes, cudaHostAllocDefault);
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    throw OutOfMemoryError(detail::concat("pinned_host out of memory: cudaHostAlloc of ", bytes,
                                          " bytes failed. Free host memory, lower the offloaded fraction or set "
                                          "pin_memory=False."));
  }
  GX_CUDA_CHECK(status);
  keep_out_of_forks(ptr, bytes);  // as the CUDA runtime does for its own pages; marked here too, not assumed
  return ptr;
}

void PinnedHostMemoryResource::do_deallocate(void* ptr, size_t /*bytes*/) {
  size_t mapped = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = registered_.find(ptr); it != registered_.end()) {
      mapped = it->second;
      registered_.erase(it);
    }
  }
  if (mapped == 0) {
    GX_CUDA_CHECK(cudaFreeHost(ptr));
    return;
  }
  GX_CUDA_CHECK(cudaHostUnregister(ptr));
  GX_INTERNAL_ASSERT(munmap(ptr, mapped) == 0, "munmap of a pinned_host range of ", mapped, " bytes failed: ",
                     std::strerror(errno), " (the range was mapped by this resource).");
}

}  // namespace gx
