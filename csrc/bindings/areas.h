// The areas of gemini_ext._C, each a function that adds its part to the module (one file each):
// a light header, so that an area needing no tensors compiles against pybind11 alone.
#pragma once

#include <pybind11/pybind11.h>

// Hidden like pybind11's own types (the module is built with hidden visibility for them).
namespace gx {
namespace bindings __attribute__((visibility("hidden"))) {

void bind_core(pybind11::module_& m);       // states, placement, search, devices, communicators, ChunkManager
void bind_manager(pybind11::module_& m);    // GeminiManager: hooks, residency, gradients, values
void bind_optimizer(pybind11::module_& m);  // the CPU kernels, state kinds, the manager's optimizer entry points
void bind_allocator(pybind11::module_& m);  // the process-wide chunk allocator and memory pressure

}  // namespace bindings
}  // namespace gx
