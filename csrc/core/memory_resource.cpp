#include "memory_resource.h"

#include <cstdlib>

#include "errors.h"

namespace gx {

void* HostMemoryResource::do_allocate(size_t bytes) {
  GX_INTERNAL_ASSERT(bytes > 0, "allocate(0) on the host resource");
  void* ptr = nullptr;
  if (posix_memalign(&ptr, kResourceAlignmentBytes, bytes) != 0 || ptr == nullptr) {
    throw OutOfMemoryError(detail::concat("host memory: could not allocate ", bytes,
                                          " bytes. Free host memory or lower the offloaded fraction."));
  }
  return ptr;
}

void HostMemoryResource::do_deallocate(void* ptr, size_t /*bytes*/) { std::free(ptr); }

}  // namespace gx
