// gemini_ext._C: the one pybind11 module. It only translates: Python values to core and torch-
// layer calls, core exceptions to Python exceptions; no logic lives here. Long-running calls
// (moves, waits, accesses) and every call that takes the manager's lock release the GIL. The
// bindings are split by area (bindings/areas.h lists them).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/version.h>

#include "bindings/areas.h"
#include "core/kernels/cpu_features.h"
#include "core/errors.h"
#include "core/tensor_state.h"

#ifdef GX_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda/cuda_backend.h"
#endif

#define GX_STR_(x) #x
#define GX_STR(x) GX_STR_(x)

namespace gx::torch_layer {
bool cuda_compiled();  // torch/chunk_views.h: true in CUDA builds of the extension
}  // namespace gx::torch_layer

namespace py = pybind11;
using namespace gx;

namespace {

py::dict build_info() {
  py::dict d;
  d["cuda"] = torch_layer::cuda_compiled();
#ifdef GX_WITH_CUDA
  d["cuda_version"] = std::to_string(CUDART_VERSION / 1000) + "." + std::to_string((CUDART_VERSION % 1000) / 10);
  d["cuda_devices"] = cuda_device_count();
#else
  d["cuda_version"] = py::none();
  d["cuda_devices"] = 0;
#endif
  d["simd_isa"] = to_string(best_simd_isa());
  d["simd_detected"] = to_string(detected_simd_isa());
  d["cpu_features"] = cpu_feature_summary();
  d["torch_compiled"] = TORCH_VERSION;
  d["cplusplus"] = static_cast<long>(__cplusplus);
  d["pybind11"] = GX_STR(PYBIND11_VERSION_MAJOR) "." GX_STR(PYBIND11_VERSION_MINOR) "." GX_STR(PYBIND11_VERSION_PATCH);
  return d;
}

// Python types of the core's exceptions, created once and kept for the life of the process.
// One translator, most derived first. (Plain PyErr_NewException rather than
// py::register_exception: raising IllegalTransition through the latter has crashed under
// torch 2.11 / Python 3.12 CUDA builds, for a cause not established.)
PyObject* g_usage_error = nullptr;
PyObject* g_oom_error = nullptr;
PyObject* g_internal_error = nullptr;
PyObject* g_illegal_transition = nullptr;

PyObject* new_exception(py::module_& m, const char* name, PyObject* base, const char* doc) {
  const std::string qualified = std::string("gemini_ext._C.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, base, nullptr);
  if (type == nullptr) throw py::error_already_set();
  Py_INCREF(type);  // one reference for the module attribute, one kept by us
  if (PyModule_AddObject(m.ptr(), name, type) != 0) throw py::error_already_set();
  return type;
}

void register_exceptions(py::module_& m) {
  g_usage_error = new_exception(m, "UsageError", PyExc_ValueError, "A caller's mistake; the message says the fix.");
  g_oom_error = new_exception(m, "OutOfMemoryError", PyExc_RuntimeError, "A tier ran out of memory.");
  g_internal_error = new_exception(m, "InternalError", PyExc_RuntimeError, "A broken invariant: a gemini_ext bug.");
  g_illegal_transition = new_exception(m, "IllegalTransition", g_internal_error,
                                       "An illegal TensorState transition: a gemini_ext bug.");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IllegalTransition& e) {
      PyErr_SetString(g_illegal_transition, e.what());
    } catch (const InternalError& e) {
      PyErr_SetString(g_internal_error, e.what());
    } catch (const OutOfMemoryError& e) {
      PyErr_SetString(g_oom_error, e.what());
    } catch (const UsageError& e) {
      PyErr_SetString(g_usage_error, e.what());
    }
  });
}

}  // namespace


PYBIND11_MODULE(_C, m) {
  m.doc() = "gemini_ext native core (chunks, pools, device backends, chunk search)";
  register_exceptions(m);
  m.def("build_info", &build_info);
  bindings::bind_core(m);
  bindings::bind_manager(m);
  bindings::bind_optimizer(m);
  bindings::bind_allocator(m);
}
