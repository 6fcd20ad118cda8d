// ProfilerRanges: the core's named ranges (core/trace_ranges.h) as torch.profiler's user scopes.
#pragma once

#include "core/trace_ranges.h"

namespace gx::torch_layer {

// One per process: it holds nothing, so every manager shares it.
TraceRanges& profiler_ranges();

}  // namespace gx::torch_layer
