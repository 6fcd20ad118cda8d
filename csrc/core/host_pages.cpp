#include "host_pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "errors.h"

namespace gx {

size_t host_page_bytes() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

namespace {
size_t round_up_to_pages(size_t bytes) {
  const size_t page = host_page_bytes();
  return (bytes + page - 1) / page * page;
}
}  // namespace

void* map_host_pages(size_t bytes) {
  GX_INTERNAL_ASSERT(bytes > 0, "map_host_pages(0)");
  const size_t mapped = round_up_to_pages(bytes);
  void* ptr = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (ptr == MAP_FAILED) {
    const int err = errno;
    throw OutOfMemoryError(detail::concat("host memory: could not map ", bytes, " bytes (", std::strerror(err),
                                          "). Free host memory or lower the offloaded fraction."));
  }
  if (madvise(ptr, mapped, MADV_DONTFORK) != 0) {
    const int err = errno;
    munmap(ptr, mapped);
    GX_INTERNAL_ASSERT(false, "madvise(MADV_DONTFORK) of a fresh mapping of ", mapped, " bytes failed: ",
                       std::strerror(err));
  }
  return ptr;
}

void unmap_host_pages(void* ptr, size_t bytes) {
  GX_INTERNAL_ASSERT(munmap(ptr, round_up_to_pages(bytes)) == 0, "munmap of ", bytes, " host bytes failed: ",
                     std::strerror(errno), " (the range was mapped by map_host_pages).");
}

size_t keep_out_of_forks(void* ptr, size_t bytes) {
  const uintptr_t page = host_page_bytes();
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(ptr) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(ptr) + bytes) / page * page;
  if (end <= begin) return 0;
  const size_t marked = end - begin;
  GX_INTERNAL_ASSERT(madvise(reinterpret_cast<void*>(begin), marked, MADV_DONTFORK) == 0,
                     "madvise(MADV_DONTFORK) of ", marked, " page-locked host bytes failed: ", std::strerror(errno));
  return marked;
}

bool host_page_mapped(const void* ptr) {
  const uintptr_t page = host_page_bytes();
  void* base = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(ptr) / page * page);
  unsigned char resident = 0;
  return mincore(base, page, &resident) == 0 || errno != ENOMEM;
}

}  // namespace gx
