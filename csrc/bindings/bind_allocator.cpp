// gemini_ext._C, allocator: the process-wide chunk allocator, its statistics and memory pressure.
#include <pybind11/stl.h>

#include "bindings/areas.h"
#include "core/memory_pressure.h"
#include "torch/allocation_window.h"
#include "torch/allocator_mode.h"

namespace gx::bindings {

namespace py = pybind11;

void bind_allocator(py::module_& m) {
  m.def("install_chunk_allocator", &torch_layer::install_chunk_allocator,
        "Installs the process-wide chunk allocator as torch's CUDA allocator (before CUDA is initialised).");
  m.def("chunk_allocator_installed", &torch_layer::chunk_allocator_installed);
  m.def("chunk_allocator_stats", &torch_layer::chunk_allocator_stats);
  m.def("reset_chunk_allocator_peak", &torch_layer::reset_chunk_allocator_peak);
  m.def("allocation_window_begin", &torch_layer::allocation_window_begin);
  m.def("allocation_window_peak", &torch_layer::allocation_window_peak);
  m.def("chunk_slot_device_bytes", &torch_layer::chunk_slot_device_bytes);
  m.def("chunk_allocator_empty_cache", &torch_layer::chunk_allocator_empty_cache,
        py::call_guard<py::gil_scoped_release>());
  m.def(
      "reclaim_device_bytes",
      [](int device, size_t bytes) { return MemoryPressure::instance().reclaim(device, bytes); },
      py::arg("device"), py::arg("bytes"), py::call_guard<py::gil_scoped_release>(),
      "Asks the managers of a device (-1: sim) to free device bytes, as an allocation under memory "
      "pressure does; returns the bytes released.");
}

}  // namespace gx::bindings
