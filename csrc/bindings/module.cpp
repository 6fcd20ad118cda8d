// gemini_ext._C: the one pybind11 module. It only translates: Python values to core and torch-
// layer calls, core exceptions to Python exceptions; no logic lives here. Long-running calls
// (moves, waits, accesses) release the GIL.
#include <torch/python.h>
#include <torch/version.h>

#include <memory>

#include "core/chunk_manager.h"
#include "core/chunk_search.h"
#include "core/cpu_features.h"
#include "core/errors.h"
#include "core/memory_pressure.h"
#include "core/static_placement.h"
#include "torch/allocation_window.h"
#include "torch/allocator_mode.h"
#include "torch/chunk_views.h"
#include "torch/cpu_adam_op.h"
#include "torch/dtype_map.h"
#include "torch/gemini_manager.h"
#include "torch/hybrid_adam.h"
#include "torch/pg_communicator.h"

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
using gx::torch_layer::GeminiManager;
using gx::torch_layer::HybridAdam;

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
  std::shared_ptr<Communicator> comm;  // declared before mgr: outlives it
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

namespace {
// Parameter groups as the Python optimizer passes them: dicts of lr, beta1, beta2, eps,
// weight_decay, adamw.
std::vector<AdamHyper> adam_hypers(const py::list& groups) {
  std::vector<AdamHyper> hs;
  for (const auto& item : groups) {
    auto d = item.cast<py::dict>();
    AdamHyper h;
    h.lr = d["lr"].cast<double>();
    h.beta1 = d["beta1"].cast<double>();
    h.beta2 = d["beta2"].cast<double>();
    h.eps = d["eps"].cast<double>();
    h.weight_decay = d["weight_decay"].cast<double>();
    h.decoupled_weight_decay = d["adamw"].cast<bool>();
    hs.push_back(h);
  }
  return hs;
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

  m.def("cpu_adam_step", &torch_layer::cpu_adam_step, py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("grad"), py::arg("param16") = std::nullopt, py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw") = true,
        py::arg("grad_scale") = 1.0, py::arg("isa") = "", py::arg("out") = std::nullopt,
        py::call_guard<py::gil_scoped_release>(),
        "Fused CPU Adam/AdamW over one chunk's fp32 master, m, v and gradient (see csrc/core/cpu_adam.h); "
        "out=(param_out, exp_avg_out, exp_avg_sq_out) writes the results there and leaves the inputs.");

  m.def(
      "static_placement",
      [](const std::vector<int64_t>& chunk_bytes, double offload_param_frac, double offload_optim_frac) {
        py::list out;
        for (const auto& p : static_placement(chunk_bytes, StaticFractions{offload_param_frac, offload_optim_frac}))
          out.append(py::make_tuple(p.param_home_on_host, p.optim_on_host));
        return out;
      },
      py::arg("chunk_bytes"), py::arg("offload_param_frac"), py::arg("offload_optim_frac"),
      "The static policy's decision per chunk: (param_home_on_host, optim_on_host); see core/static_placement.h.");

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

  py::class_<torch_layer::ProcessGroupCommunicator, std::shared_ptr<torch_layer::ProcessGroupCommunicator>>(
      m, "ProcessGroupCommunicator")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>, std::shared_ptr<DeviceContext>>(),
           py::arg("process_group"), py::arg("context"))
      .def_property_readonly("world_size", &torch_layer::ProcessGroupCommunicator::world_size)
      .def_property_readonly("rank", &torch_layer::ProcessGroupCommunicator::rank)
      .def_property_readonly("name", &torch_layer::ProcessGroupCommunicator::name)
      .def_property_readonly("calls", &torch_layer::ProcessGroupCommunicator::calls);

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
              const std::string& home_tier, int64_t alignment_numel) {
             const auto scalar_type = torch::python::detail::py_object_to_dtype(dtype);
             p.mgr->create_group(group, torch_layer::to_gx_dtype(scalar_type), chunk_size_numel, parse_tier(home_tier),
                                 alignment_numel);
           },
           py::arg("group"), py::arg("dtype"), py::arg("chunk_size_numel"), py::arg("home_tier"),
           py::arg("alignment_numel") = 0)
      .def("allocate_copy", [](PyChunkManager& p, ChunkId id, const std::string& tier) {
             p.mgr->allocate_copy(id, parse_tier(tier));
           })
      .def("transfer",
           [](PyChunkManager& p, ChunkId id, const std::string& from, const std::string& to, bool async) {
             const Tier f = parse_tier(from), t = parse_tier(to);
             py::gil_scoped_release nogil;
             p.ctx->sync_compute_stream();
             p.mgr->transfer(id, f, t, async);
           },
           py::arg("chunk_id"), py::arg("from_tier"), py::arg("to_tier"), py::arg("async_") = false)
      .def("discard_copy", [](PyChunkManager& p, ChunkId id, const std::string& tier) {
             p.mgr->discard_copy(id, parse_tier(tier));
           })
      .def("register_tensor",
           [](PyChunkManager& p, const std::string& group, const std::string& name, int64_t numel,
              std::vector<int64_t> shape) {
             auto h = p.mgr->register_tensor(group, name, numel, shape);
             return py::make_tuple(h.chunk_id, h.slot_index);
           })
      .def("close_chunks", [](PyChunkManager& p) { p.mgr->close_chunks(); })
      .def("finalize",
           [](PyChunkManager& p, const std::vector<ChunkId>& device_first, const std::vector<ChunkId>& without_copy) {
             p.mgr->finalize(device_first, without_copy);
           },
           py::arg("device_first") = std::vector<ChunkId>{}, py::arg("without_copy") = std::vector<ChunkId>{})
      .def("access", [](PyChunkManager& p, ChunkId id) { p.ctx->sync_compute_stream(); p.mgr->access(id); },
           py::call_guard<py::gil_scoped_release>())
      .def("release", [](PyChunkManager& p, ChunkId id, bool reshard) { p.mgr->release(id, reshard); },
           py::arg("chunk_id"), py::arg("reshard") = true)
      .def("ungather", [](PyChunkManager& p, ChunkId id) { p.mgr->ungather(id); })
      .def("allocate_gathered", [](PyChunkManager& p, ChunkId id) { p.mgr->allocate_gathered(id); })
      .def("set_communicator",
           [](PyChunkManager& p, std::shared_ptr<torch_layer::ProcessGroupCommunicator> comm) {
             p.mgr->set_communicator(comm.get());
             p.comm = comm;
           })
      .def_property_readonly("sharded", [](PyChunkManager& p) { return p.mgr->sharded(); })
      .def("gathered_bytes", [](PyChunkManager& p) { return stat_dict(p.mgr->gathered_bytes()); })
      .def("move",
           [](PyChunkManager& p, ChunkId id, const std::string& tier, bool async) {
             const Tier t = parse_tier(tier);
             py::gil_scoped_release nogil;
             p.ctx->sync_compute_stream();
             p.mgr->move(id, t, async);
           },
           py::arg("chunk_id"), py::arg("tier"), py::arg("async_") = false)
      .def("wait", [](PyChunkManager& p, ChunkId id) { p.mgr->wait(id); }, py::call_guard<py::gil_scoped_release>())
      .def("poll", [](PyChunkManager& p) { p.mgr->poll(); }, py::call_guard<py::gil_scoped_release>())
      .def("reduce", [](PyChunkManager& p, ChunkId id) { p.mgr->reduce(id); })
      .def("reduce_scatter",
           [](PyChunkManager& p, ChunkId id) { p.ctx->sync_compute_stream(); p.mgr->reduce_scatter(id); },
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", [](PyChunkManager& p) { return p.mgr->rank(); })
      .def_property_readonly("world_size", [](PyChunkManager& p) { return p.mgr->world_size(); })
      .def("in_flight", [](PyChunkManager& p, ChunkId id) { return p.mgr->in_flight(id); })
      .def("transition", [](PyChunkManager& p, py::tuple h, TensorState to) { p.mgr->transition(handle_of(h), to); })
      .def("state", [](PyChunkManager& p, py::tuple h) { return p.mgr->state(handle_of(h)); })
      .def("tensor_view",
           [](PyChunkManager& p, py::tuple h, const std::string& tier) {
             return torch_layer::tensor_view(*p.ctx, *p.mgr, handle_of(h), parse_tier(tier));
           })
      .def("gathered_view",
           [](PyChunkManager& p, py::tuple h) { return torch_layer::gathered_view(*p.ctx, *p.mgr, handle_of(h)); })
      .def("write_slot",
           [](PyChunkManager& p, py::tuple h, const std::string& tier, const at::Tensor& value) {
             torch_layer::write_slot_part(*p.ctx, *p.mgr, handle_of(h), parse_tier(tier), value);
           })
      .def("gathered_chunk_view",
           [](PyChunkManager& p, ChunkId id) { return torch_layer::gathered_chunk_view(*p.ctx, *p.mgr, id); })
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
      .def("pool_stats",
           [](PyChunkManager& p, const std::string& tier) {
             const ChunkAllocator& a = p.mgr->allocator();
             const Tier t = parse_tier(tier);
             py::dict d;
             d["in_use_bytes"] = stat_dict(a.in_use_bytes(t));
             d["reserved_bytes"] = stat_dict(a.reserved_bytes(t));
             d["slots_taken_from_arena"] = a.upstream_allocations(t);
             d["arena_extents"] = a.arena_extents(t);
             d["ordered_reuses"] = a.ordered_reuses(t);  // slots reused with their first use ordered after their last
             d["reuse_waits"] = a.reuse_waits(t);
             return d;
           })
      .def("trim", [](PyChunkManager& p, const std::string& tier) { return p.mgr->trim(parse_tier(tier)); },
           py::call_guard<py::gil_scoped_release>())
      .def("reserve_arena",
           [](PyChunkManager& p, const std::string& tier, size_t bytes) { p.mgr->reserve_arena(parse_tier(tier), bytes); })
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
        d["all_gathers"] = t.all_gathers;
        d["reduce_scatters"] = t.reduce_scatters;
        d["gather_prefetches"] = t.gather_prefetches;
        d["reductions"] = t.reductions;
        d["prefetches"] = t.prefetches;
        d["prefetch_hits"] = t.prefetch_hits;
        d["prefetch_wasted"] = t.prefetch_wasted;
        d["copy_wait_seconds"] = t.copy_wait_seconds;
        d["copy_waits"] = t.copy_waits;
        return d;
      });

  py::class_<GeminiManager>(m, "GeminiManager")
      .def(py::init([](PyChunkManager& cm, const py::list& sets, const py::list& params, const std::string& policy) {
             std::vector<torch_layer::ChunkSetSpec> specs;
             for (const auto& item : sets) {
               auto d = item.cast<py::dict>();
               torch_layer::ChunkSetSpec s;
               s.param = d["param"].cast<ChunkId>();
               s.grad = d["grad"].cast<ChunkId>();
               s.master = d["master"].cast<ChunkId>();
               s.exp_avg = d["exp_avg"].cast<ChunkId>();
               s.exp_avg_sq = d["exp_avg_sq"].cast<ChunkId>();
               s.optim_on_host = d["optim_on_host"].cast<bool>();
               s.param_home_on_host = d["param_home_on_host"].cast<bool>();
               if (d.contains("keep_gathered")) s.keep_gathered = d["keep_gathered"].cast<bool>();
               if (d.contains("grad_stays_on_device")) s.grad_stays_on_device = d["grad_stays_on_device"].cast<bool>();
               specs.push_back(s);
             }
             std::vector<torch_layer::ParamSpec> ps;
             for (const auto& item : params) {
               auto t = item.cast<py::tuple>();
               ps.push_back(torch_layer::ParamSpec{t[0].cast<ChunkId>(), t[1].cast<size_t>(), t[2].cast<bool>()});
             }
             return std::make_unique<GeminiManager>(cm.ctx, *cm.mgr, std::move(specs), std::move(ps), policy);
           }),
           py::arg("chunk_manager"), py::arg("sets"), py::arg("params"), py::arg("policy"), py::keep_alive<1, 2>())
      .def("param_views", &GeminiManager::param_views)
      .def("param_binding", &GeminiManager::param_binding)
      .def("watch_params", &GeminiManager::watch_params)
      .def("guard_stepping_params", &GeminiManager::guard_stepping_params, py::call_guard<py::gil_scoped_release>())
      .def("written_params", &GeminiManager::written_params)
      .def("note_param_versions", &GeminiManager::note_param_versions)
      .def("apply_placement", &GeminiManager::apply_placement, py::call_guard<py::gil_scoped_release>())
      .def("register_module", &GeminiManager::register_module)
      .def("pre_forward", &GeminiManager::pre_forward, py::call_guard<py::gil_scoped_release>())
      .def("post_forward", &GeminiManager::post_forward, py::call_guard<py::gil_scoped_release>())
      .def("pre_backward", &GeminiManager::pre_backward, py::call_guard<py::gil_scoped_release>())
      .def("post_backward", &GeminiManager::post_backward, py::call_guard<py::gil_scoped_release>())
      .def("post_accumulate_grad",
           [](GeminiManager& g, int param, at::Tensor p) { g.post_accumulate_grad(param, p); },
           py::call_guard<py::gil_scoped_release>())
      .def("end_backward", &GeminiManager::end_backward, py::call_guard<py::gil_scoped_release>())
      .def("set_no_sync", &GeminiManager::set_no_sync)
      .def("set_async_reduce", &GeminiManager::set_async_reduce)
      .def("set_max_prefetch", &GeminiManager::set_max_prefetch)
      .def("set_overlap_optimizer", &GeminiManager::set_overlap_optimizer)
      .def("hold_optimizer_thread", &GeminiManager::hold_optimizer_thread)
      .def("set_optimizer_task_delay_us", &GeminiManager::set_optimizer_task_delay_us)
      .def("pending_steps", [](GeminiManager& m) {
        std::lock_guard<OwnedMutex> lock(m.mutex());
        return m.pending_steps();
      }, py::call_guard<py::gil_scoped_release>())
      .def("settle_all", &GeminiManager::settle_all, py::call_guard<py::gil_scoped_release>())
      .def("set_device_budget", &GeminiManager::set_device_budget, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("device_budget", &GeminiManager::device_budget)
      .def("set_optim_on_host", &GeminiManager::set_optim_on_host, py::call_guard<py::gil_scoped_release>())
      .def("end_iteration", &GeminiManager::end_iteration, py::call_guard<py::gil_scoped_release>())
      .def("trace_info",
           [](GeminiManager& g) {
             const AccessTrace& t = g.trace();
             py::dict d;
             d["recorded"] = t.recorded();
             d["iterations"] = t.iterations();
             d["rerecordings"] = t.rerecordings();
             d["usable"] = t.usable();
             return d;
           })
      .def("timeline",
           [](GeminiManager& g) {
             py::list out;
             for (const auto& e : g.timeline())
               out.append(py::make_tuple(e.seconds, std::string(1, e.kind), e.chunk, e.device_bytes));
             return out;
           })
      .def("flush_grads", &GeminiManager::flush_grads, py::call_guard<py::gil_scoped_release>())
      .def("reclaim_device_bytes", &GeminiManager::reclaim_device_bytes, py::call_guard<py::gil_scoped_release>())
      .def("stop_reclaiming", &GeminiManager::stop_reclaiming)
      .def_property_readonly("no_sync", &GeminiManager::no_sync)
      .def_property_readonly("in_backward", &GeminiManager::in_backward)
      .def("zero_grad", &GeminiManager::zero_grad, py::call_guard<py::gil_scoped_release>())
      .def("read", &GeminiManager::read, py::call_guard<py::gil_scoped_release>())
      .def("read_to",
           [](GeminiManager& g, const std::string& kind, int param, py::object device, py::object dtype) {
             const at::Device target = torch::python::detail::py_object_to_device(device);
             const at::ScalarType scalar_type = torch::python::detail::py_object_to_dtype(dtype);
             py::gil_scoped_release release;
             return g.read_to(kind, param, target, scalar_type);
           },
           py::arg("kind"), py::arg("param"), py::arg("device"), py::arg("dtype"))
      .def("release_read_cache", &GeminiManager::release_read_cache, py::call_guard<py::gil_scoped_release>())
      .def("write", &GeminiManager::write, py::call_guard<py::gil_scoped_release>())
      .def("read_local", &GeminiManager::read_local, py::call_guard<py::gil_scoped_release>())
      .def("set_replica_communicator",
           [](GeminiManager& g, std::shared_ptr<torch_layer::ProcessGroupCommunicator> comm) {
             g.set_replica_communicator(comm.get());
           },
           py::keep_alive<1, 2>())
      .def("read_grad",
           [](GeminiManager& g, int param) -> py::object {
             at::Tensor t;
             {
               py::gil_scoped_release nogil;
               t = g.read_grad(param);
             }
             if (!t.defined()) return py::none();
             return py::cast(t);
           })
      .def("step_of", &GeminiManager::step_of)
      .def("set_step", &GeminiManager::set_step)
      .def("synchronize", &GeminiManager::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("has_grad",
           [](GeminiManager& g, int param) {
             const auto& ps = g.params().at(static_cast<size_t>(param));
             return g.sets()[static_cast<size_t>(g.set_of_chunk(ps.chunk))].has_grad[ps.slot] != 0;
           })
      .def("set_placements",
           [](GeminiManager& g) {
             py::list out;
             for (const auto& s : g.sets()) {
               py::dict d;
               d["param_chunk"] = s.spec.param;
               d["trainable"] = s.trainable;
               d["optim_on_host"] = s.spec.optim_on_host;
               d["param_home_on_host"] = s.spec.param_home_on_host;
               d["keep_gathered"] = s.spec.keep_gathered;
               d["grad_stays_on_device"] = s.spec.grad_stays_on_device;
               out.append(d);
             }
             return out;
           })
      .def("counters", [](GeminiManager& g) {
        const auto& c = g.counters();
        py::dict d;
        d["evictions"] = c.evictions;
        d["sync_fetch_waits"] = c.sync_fetch_waits;
        d["wait_seconds"] = c.wait_seconds;
        d["evicted_bytes"] = c.evicted_bytes;
        d["fetches"] = c.fetches;
        d["grad_chunks_offloaded"] = c.grad_chunks_offloaded;
        d["flushed_chunks"] = c.flushed_chunks;
        d["backward_passes"] = c.backward_passes;
        d["reclaims"] = c.reclaims;
        d["reclaimed_bytes"] = c.reclaimed_bytes;
        d["optimizer_wait_seconds"] = c.optimizer_wait_seconds;
        d["optimizer_waits"] = c.optimizer_waits;
        return d;
      });

  py::class_<HybridAdam>(m, "HybridAdam")
      .def(py::init<GeminiManager&>(), py::arg("manager"), py::keep_alive<1, 2>())
      .def("set_param_groups", &HybridAdam::set_param_groups)
      .def("grad_norm_sq", &HybridAdam::grad_norm_sq, py::call_guard<py::gil_scoped_release>())
      .def("step",
           [](HybridAdam& a, const py::list& groups, double grad_multiplier) {
             std::vector<AdamHyper> hs = adam_hypers(groups);
             py::gil_scoped_release nogil;
             a.step(hs, grad_multiplier);
           })
      .def("arm",
           [](HybridAdam& a, const py::list& groups) {
             std::vector<AdamHyper> hs = adam_hypers(groups);
             py::gil_scoped_release nogil;
             a.arm(hs);
           })
      .def("disarm", &HybridAdam::disarm, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("armed", &HybridAdam::armed)
      .def("spare_bytes_needed", &HybridAdam::spare_bytes_needed, py::call_guard<py::gil_scoped_release>())
      .def("spare_bytes", &HybridAdam::spare_bytes, py::call_guard<py::gil_scoped_release>())
      .def("release_spares", &HybridAdam::release_spares, py::call_guard<py::gil_scoped_release>())
      .def("speculations", [](HybridAdam& a) {
        py::dict d;
        d["confirmed"] = a.speculations_confirmed();
        d["dropped"] = a.speculations_dropped();
        return d;
      })
      .def("last_step", [](HybridAdam& a) {
        gx::torch_layer::StepStats s;
        {
          py::gil_scoped_release nogil;  // waits for the manager's mutex
          s = a.last_step();
        }
        py::dict d;
        d["host_params"] = s.host_params;
        d["device_params"] = s.device_params;
        d["host_seconds"] = s.host_seconds;
        d["launch_seconds"] = s.launch_seconds;
        d["device_seconds"] = s.device_seconds;
        d["pending_sets"] = s.pending_sets;
        return d;
      });
}
