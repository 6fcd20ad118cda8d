// Non-model memory windows: the peak of torch's allocations on a device since a window began,
// measured without resetting any peak statistic the user reads (see core/peak_window.h).
//
// Under GEMINI_EXT_ALLOCATOR=default the window follows torch's caching allocator through an
// allocator trace tracker (attached once per process, at the first window; it only adds and
// subtracts requested sizes, lock-free). Under `chunk` it is the process allocator's own window.
// CPU builds: windows read 0.
#pragma once

#include <cstdint>

namespace gx::torch_layer {

void allocation_window_begin(int device);
int64_t allocation_window_peak(int device);

}  // namespace gx::torch_layer
