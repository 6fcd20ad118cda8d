// The process-wide allocator mode (GEMINI_EXT_ALLOCATOR=chunk): installs ProcessAllocator as
// torch's CUDA allocator through the pluggable-allocator interface, with empty_cache,
// record_stream and set_per_process_memory_fraction wired to it, and exposes its statistics.
// CPU builds have the functions too; installing there is a caller's mistake with a clear error.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace gx::torch_layer {

void install_chunk_allocator();  // once, before CUDA is initialised; throws a clear error otherwise
bool chunk_allocator_installed();
std::map<std::string, int64_t> chunk_allocator_stats();  // exact counters (empty when not installed)
void reset_chunk_allocator_peak();
int64_t chunk_allocator_empty_cache();
int64_t chunk_slot_device_bytes();  // device bytes of chunk slots (cudaMalloc'd by the chunk pools), all devices

}  // namespace gx::torch_layer
