// Host pages the engine owns, kept out of forked children.
//
// Design note. A process that forks (a DataLoader's workers, `subprocess` before exec, os.fork)
// shares its anonymous memory with the child copy-on-write: every page the parent writes
// afterwards is copied, for as long as the child lives. The engine rewrites all of its host
// memory at every step (CPU optimizer, gradient copies, parameter fetches into the sim device),
// so a persistent DataLoader with two workers doubles or triples what the model's host state
// costs, and at 7B parameters on a 125 GiB host that ends in the kernel's out-of-memory killer.
// cudaHostAlloc avoids it by marking its pages MADV_DONTFORK: the child does not get them at
// all. The same mark goes on every host byte of the engine:
//  * `map_host_pages` maps whole anonymous pages (mmap) and marks them; `unmap_host_pages` gives
//    them back. Only whole mappings of our own may be marked: marking part of a page that
//    malloc shares with other data would take that data from the child too.
//  * `keep_out_of_forks` marks the whole pages inside a range another allocator handed out
//    (page-locked memory from the CUDA runtime); the partial pages at its ends stay forkable.
// What a forked child may touch: nothing the engine owns. Its chunk memory is absent in the
// child (reading a parameter view there faults in the child only); the parent is unaffected.
#pragma once

#include <cstddef>

namespace gx {

size_t host_page_bytes();
// Whole anonymous pages, zero-filled and not inherited by forked children. Throws
// OutOfMemoryError naming the size when the kernel refuses the mapping.
void* map_host_pages(size_t bytes);
// Gives back exactly what map_host_pages(bytes) returned.
void unmap_host_pages(void* ptr, size_t bytes);
// Marks the whole pages within [ptr, ptr + bytes) MADV_DONTFORK; returns the bytes marked.
size_t keep_out_of_forks(void* ptr, size_t bytes);
// Whether the page holding `ptr` is mapped in this process (tests: after fork, in the child).
bool host_page_mapped(const void* ptr);

}  // namespace gx
