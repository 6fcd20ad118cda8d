#include "torch/allocator_mode.h"

#include "core/errors.h"

#ifdef GX_WITH_CUDA
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include "core/memory_pressure.h"
#include "cuda/cuda_backend.h"
#include "cuda/process_allocator.h"
#endif

namespace gx::torch_layer {

namespace {
bool g_installed = false;
}

bool chunk_allocator_installed() { return g_installed; }

#ifdef GX_WITH_CUDA

void install_chunk_allocator() {
  if (g_installed) return;
  namespace pluggable = torch::cuda::CUDAPluggableAllocator;
  auto base = pluggable::createCustomAllocator(
      [](size_t size, int device, cudaStream_t stream) -> void* {
        ProcessAllocator& a = ProcessAllocator::instance();
        void* p = a.allocate(size, device, stream);
        if (p == nullptr && size > 0) {
          const ProcessAllocatorStats s = a.stats();
          // Built with concat (std::to_string): integer formatting through std::ostream has
          // crashed inside this extension (core/errors.h), and torch's TORCH_CHECK formats so.
          std::string msg = detail::concat(
              "gemini_ext chunk allocator: out of memory allocating ", size, " bytes on cuda:", device, " (limited by ",
              a.last_error(), ") after evicting every chunk no module computes on: ", s.allocated_bytes.current,
              " bytes allocated by torch, ", cuda_device_bytes_in_use(device),
              " bytes of chunk slots on the device. Lower the batch size or activation memory (activation "
              "checkpointing), or gpu_memory_limit / const_gpu_budget so fewer chunks live on the device.");
          throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg);
        }
        return p;
      },
      [](void* ptr, size_t size, int device, cudaStream_t stream) {
        ProcessAllocator::instance().free(ptr, size, device, stream);
      });
  auto alloc = std::dynamic_pointer_cast<pluggable::CUDAPluggableAllocator>(base);
  GX_INTERNAL_ASSERT(alloc != nullptr, "torch's createCustomAllocator did not return a CUDAPluggableAllocator");
  alloc->set_reset_fn([] { ProcessAllocator::instance().empty_cache(); });
  alloc->set_memory_fraction_fn(
      [](double fraction, int device) { ProcessAllocator::instance().set_memory_fraction(fraction, device); });
  alloc->set_record_stream_fn(
      [](void* ptr, cudaStream_t stream) { ProcessAllocator::instance().record_stream(ptr, stream); });
  pluggable::changeCurrentAllocator(base);  // refuses (c10::Error) once CUDA's allocator was used
  MemoryPressure::instance().set_cache_releaser(
      [](int device) { return ProcessAllocator::instance().release_cache(device); });
  ProcessAllocator::instance().set_external_bytes_fn(&cuda_device_bytes_in_use);
  g_installed = true;
}

std::map<std::string, int64_t> chunk_allocator_stats() {
  if (!g_installed) return {};
  const ProcessAllocatorStats s = ProcessAllocator::instance().stats();
  return {{"allocated_bytes.current", s.allocated_bytes.current},
          {"allocated_bytes.peak", s.allocated_bytes.peak},
          {"allocated_bytes.allocated", s.allocated_bytes.allocated},
          {"allocated_bytes.freed", s.allocated_bytes.freed},
          {"reserved_bytes.current", s.reserved_bytes},
          {"reserved_bytes.peak", s.reserved_bytes_peak},
          {"allocations", s.allocations},
          {"frees", s.frees},
          {"ooms_rescued", s.ooms_rescued},
          {"ooms_failed", s.ooms_failed},
          {"reclaimed_bytes", s.reclaimed_bytes},
          {"record_streams", s.record_streams}};
}

void reset_chunk_allocator_peak() {
  if (g_installed) ProcessAllocator::instance().reset_peak();
}

int64_t chunk_slot_device_bytes() { return cuda_device_bytes_in_use(-1); }

int64_t chunk_allocator_empty_cache() {
  return g_installed ? static_cast<int64_t>(ProcessAllocator::instance().empty_cache()) : 0;
}

#else

void install_chunk_allocator() {
  throw UsageError(
      "GEMINI_EXT_ALLOCATOR=chunk: this build of gemini_ext is CPU-only, so there is no CUDA allocator to replace. "
      "Unset GEMINI_EXT_ALLOCATOR (or set it to 'default'), or install a CUDA build of gemini_ext.");
}
std::map<std::string, int64_t> chunk_allocator_stats() { return {}; }
void reset_chunk_allocator_peak() {}
int64_t chunk_allocator_empty_cache() { return 0; }
int64_t chunk_slot_device_bytes() { return 0; }

#endif

}  // namespace gx::torch_layer
