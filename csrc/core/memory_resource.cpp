#include "memory_resource.h"

#include "errors.h"
#include "host_pages.h"

namespace gx {

void* HostMemoryResource::do_allocate(size_t bytes) {
  GX_INTERNAL_ASSERT(bytes > 0, "allocate(0) on the host resource");
  return map_host_pages(bytes);  // page-aligned, zeroed, not inherited by forked children
}

void HostMemoryResource::do_deallocate(void* ptr, size_t bytes) { unmap_host_pages(ptr, bytes); }

}  // namespace gx
