// gemini_ext._C: the one pybind11 module. It only translates: Python values to core and torch-
// layer calls, core exceptions to Python exceptions; no logic lives here. Long-running calls
// (moves, waits, accesses) release the GIL.
#include <torch/extension.h>

#include <memory>

#include "core/chunk_manager.h"
#include "core/chunk_search.h"
#include "core/cpu_features.h"
#include "core/errors.h"
#include "torch/chunk_views.h"
#include "torch/cpu_adam_op.h"
#include "torch/dtype_map.h"

#ifdef GX_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda/cuda_backend.h"
#endif

#define GX_STR_(x) #x
#define GX_STR(x) GX_STR_(x)

namespace py = pybind11;
using namespace gx;
using gx::torch_layer::DeviceContext;
using gx::torch_layer::DeviceOptions;

namespace {

Tier parse_tier(const std::string& name) {
  for (Tier t : {Tier::kDevice, Tier::kPinnedHost, Tier::kPageableHost})
    if (name == to_string(t)) return t;
  if (name == "host") return Tier::kPageableHost;
  GX_CHECK(false, "tier: expected 'device', 'pinned_host' or 'pageable_host', got '", name, "'.");
}

py::dict stat_dict(const Stat& s) {
  py::dict d;
  d["current"] = s.current;
  d["peak"] = s.peak;
  d["allocated"] = s.allocated;
  d["freed"] = s.freed;
  return d;
}

// A ChunkManager together with the DeviceContext it runs on (the context must outlive it).
struct PyChunkManager {
  std::shared_ptr<DeviceContext> ctx;
  std::unique_ptr<ChunkManager> mgr;
};

TensorHandle handle_of(const py::tuple& t) {
  GX_CHECK(t.size() == 2, "tensor handle: expected (chunk_id, slot_index), got a tuple of ", t.size(), ".");
  return TensorHandle{t[0].cast<ChunkId>(), t[1].cast<size_t>()};
}

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
// py::register_exception: raising IllegalTransition through the latter segfaulted on the GPU
// machine, torch 2.11 / Python 3.12, 2026-11-29; the cause was not established.)
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

  py::enum_<TensorState>(m, "TensorState")
      .value("FREE", TensorState::kFree)
      .value("COMPUTE", TensorState::kCompute)
      .value("HOLD", TensorState::kHold)
      .value("HOLD_AFTER_BWD", TensorState::kHoldAfterBwd)
      .value("READY_FOR_REDUCE", TensorState::kReadyForReduce);
  m.def("is_legal_transition", &is_legal_transition);

  m.def("build_info", &build_info);

  m.def("cpu_adam_step", &torch_layer::cpu_adam_step, py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("grad"), py::arg("param16") = std::nullopt, py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw") = true,
        py::arg("grad_scale") = 1.0, py::arg("isa") = "", py::call_guard<py::gil_scoped_release>(),
        "Fused CPU Adam/AdamW over one chunk's fp32 master, m, v and gradient (see csrc/core/cpu_adam.h).");

  m.def(
      "search_chunk_size",
      [](std::vector<int64_t> numels, int64_t search_range_numel, int64_t min_chunk_size_numel,
         int64_t search_interval_numel, int64_t alignment_numel, int world_size, bool filter_exlarge) {
        ChunkSearchInput in{std::move(numels), search_range_numel, min_chunk_size_numel, search_interval_numel,
                            alignment_numel,   world_size,         filter_exlarge};
        ChunkSearchResult r;
        {
          py::gil_scoped_release nogil;
          r = search_chunk_size(in);
        }
        py::dict d;
        d["chunk_size_numel"] = r.chunk_size_numel;
        d["wasted_numel"] = r.wasted_numel;
        d["num_chunks"] = r.num_chunks;
        d["total_numel"] = r.total_numel;
        d["exlarge_indices"] = r.exlarge_indices;
        d["candidates"] = r.candidates;
        return d;
      },
      py::arg("numels"), py::arg("search_range_numel"), py::arg("min_chunk_size_numel"),
      py::arg("search_interval_numel"), py::arg("alignment_numel") = 1, py::arg("world_size") = 1,
      py::arg("filter_exlarge") = true);

  py::class_<DeviceContext, std::shared_ptr<DeviceContext>>(m, "DeviceContext")
      .def(py::init([](const std::string& kind, int device_index, size_t capacity_bytes, int64_t sim_max_copy_delay_us,
                       uint64_t sim_seed) {
             return std::make_shared<DeviceContext>(
                 DeviceOptions{kind, device_index, capacity_bytes, sim_max_copy_delay_us, sim_seed});
           }),
           py::arg("kind"), py::arg("device_index") = 0, py::arg("capacity_bytes") = 0,
           py::arg("sim_max_copy_delay_us") = 0, py::arg("sim_seed") = 0)
      .def_property_readonly("kind", &DeviceContext::kind)
      .def_property_readonly("capacity_bytes", [](DeviceContext& c) { return c.backend().device_capacity_bytes(); })
      .def_property_readonly("host_memory_is_pinned", [](DeviceContext& c) { return c.backend().host_memory_is_pinned(); })
      .def("torch_device", [](DeviceContext& c) { return py::str(c.device_for(Tier::kDevice).str()); })
      .def("synchronize", [](DeviceContext& c) { c.backend().synchronize_all(); },
           py::call_guard<py::gil_scoped_release>());

  py::class_<PyChunkManager>(m, "ChunkManager")
      .def(py::init([](std::shared_ptr<DeviceContext> ctx, int world_size, int rank, size_t alignment_bytes,
                       bool pin_memory) {
             auto p = std::make_unique<PyChunkManager>();
             p->ctx = ctx;
             p->mgr = std::make_unique<ChunkManager>(ctx->backend(),
                                                     ChunkManagerConfig{world_size, rank, alignment_bytes, pin_memory});
             return p;
           }),
           py::arg("context"), py::arg("world_size") = 1, py::arg("rank") = 0, py::arg("alignment_bytes") = 64,
           py::arg("pin_memory") = true)
      .def("create_group",
           [](PyChunkManager& p, const std::string& group, py::object dtype, int64_t chunk_size_numel,
              const std::string& home_tier) {
             const auto scalar_type = torch::python::detail::py_object_to_dtype(dtype);
             p.mgr->create_group(group, torch_layer::to_gx_dtype(scalar_type), chunk_size_numel, parse_tier(home_tier));
           })
      .def("register_tensor",
           [](PyChunkManager& p, const std::string& group, const std::string& name, int64_t numel,
              std::vector<int64_t> shape) {
             auto h = p.mgr->register_tensor(group, name, numel, shape);
             return py::make_tuple(h.chunk_id, h.slot_index);
           })
      .def("finalize", [](PyChunkManager& p) { p.mgr->finalize(); })
      .def("access", [](PyChunkManager& p, ChunkId id) { p.ctx->sync_compute_stream(); p.mgr->access(id); },
           py::call_guard<py::gil_scoped_release>())
      .def("release", [](PyChunkManager& p, ChunkId id) { p.mgr->release(id); })
      .def("move",
           [](PyChunkManager& p, ChunkId id, const std::string& tier, bool async) {
             const Tier t = parse_tier(tier);
             py::gil_scoped_release nogil;
             p.ctx->sync_compute_stream();
             p.mgr->move(id, t, async);
           },
           py::arg("chunk_id"), py::arg("tier"), py::arg("async_") = false)
      .def("wait", [](PyChunkManager& p, ChunkId id) { p.mgr->wait(id); }, py::call_guard<py::gil_scoped_release>())
      .def("poll", [](PyChunkManager& p) { p.mgr->poll(); })
      .def("reduce", [](PyChunkManager& p, ChunkId id) { p.mgr->reduce(id); })
      .def("in_flight", [](PyChunkManager& p, ChunkId id) { return p.mgr->in_flight(id); })
      .def("transition", [](PyChunkManager& p, py::tuple h, TensorState to) { p.mgr->transition(handle_of(h), to); })
      .def("state", [](PyChunkManager& p, py::tuple h) { return p.mgr->state(handle_of(h)); })
      .def("tensor_view",
           [](PyChunkManager& p, py::tuple h, const std::string& tier) {
             return torch_layer::tensor_view(*p.ctx, *p.mgr, handle_of(h), parse_tier(tier));
           })
      .def("gathered_view",
           [](PyChunkManager& p, py::tuple h) { return torch_layer::gathered_view(*p.ctx, *p.mgr, handle_of(h)); })
      .def("shard_view",
           [](PyChunkManager& p, ChunkId id, const std::string& tier) {
             return torch_layer::shard_view(*p.ctx, *p.mgr, id, parse_tier(tier));
           })
      .def("chunk_info",
           [](PyChunkManager& p, ChunkId id) {
             const Chunk& c = p.mgr->chunk(id);
             py::dict d;
             d["id"] = c.id();
             d["group"] = c.group();
             d["dtype"] = to_string(c.dtype());
             d["capacity_numel"] = c.capacity_numel();
             d["padded_numel"] = c.closed() ? c.padded_numel() : -1;
             d["shard_numel"] = c.closed() ? c.shard_numel() : -1;
             d["payload_numel"] = c.payload_numel();
             d["shard_tiers"] = c.shard_tiers().to_string();
             d["gathered"] = c.gathered();
             d["can_release"] = c.can_release();
             d["can_reduce"] = c.can_reduce();
             d["can_move"] = c.can_move();
             py::list slots;
             for (const auto& s : c.slots())
               slots.append(py::make_tuple(s.name, s.offset_numel, s.numel, s.shape, s.state));
             d["slots"] = slots;
             return d;
           })
      .def_property_readonly("num_chunks", [](PyChunkManager& p) { return p.mgr->num_chunks(); })
      .def_property_readonly("host_tier", [](PyChunkManager& p) { return std::string(to_string(p.mgr->host_tier())); })
      .def("group_chunk_ids", [](PyChunkManager& p, const std::string& g) { return p.mgr->group(g).chunk_ids; })
      .def("tier_bytes", [](PyChunkManager& p, const std::string& tier) { return stat_dict(p.mgr->tier_bytes(parse_tier(tier))); })
      .def("reserved_bytes",
           [](PyChunkManager& p, const std::string& tier) { return stat_dict(p.mgr->allocator().reserved_bytes(parse_tier(tier))); })
      .def("wasted_bytes", [](PyChunkManager& p) { return p.mgr->wasted_bytes(); })
      .def("traffic", [](PyChunkManager& p) {
        const TrafficStats& t = p.mgr->traffic();
        py::dict d;
        d["h2d_bytes"] = t.h2d_bytes;
        d["d2h_bytes"] = t.d2h_bytes;
        d["h2h_bytes"] = t.h2h_bytes;
        d["moves"] = t.moves;
        d["fetches"] = t.fetches;
        d["accesses"] = t.accesses;
        d["reductions"] = t.reductions;
        return d;
      });
}
