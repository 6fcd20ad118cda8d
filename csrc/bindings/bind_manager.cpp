// gemini_ext._C, manager: the GeminiManager's hooks, residency, gradients and values. Every call
// that takes the manager's lock releases the GIL (hooks run on autograd threads too).
#include "bindings/common.h"
#include "torch/manager/manager.h"
#include "torch/pg_communicator.h"

namespace gx::bindings {

using torch_layer::EngineCounters;
using torch_layer::GeminiManager;
using torch_layer::SetPlacement;
using nogil = py::call_guard<py::gil_scoped_release>;

namespace {

ChunkSetSpec set_spec_of(const py::dict& d) {
  ChunkSetSpec s;
  s.param = d["param"].cast<ChunkId>();
  s.grad = d["grad"].cast<ChunkId>();
  s.master = d["master"].cast<ChunkId>();
  for (const auto& item : d["states"].cast<py::list>()) {
    auto kind_and_id = item.cast<py::tuple>();
    s.states.emplace_back(parse_state_kind(kind_and_id[0].cast<std::string>()),
                          kind_and_id[1].cast<ChunkId>());
  }
  s.optim_on_host = d["optim_on_host"].cast<bool>();
  s.param_home_on_host = d["param_home_on_host"].cast<bool>();
  s.keep_gathered = d["keep_gathered"].cast<bool>();
  s.grad_stays_on_device = d["grad_stays_on_device"].cast<bool>();
  return s;
}

StateKind kind_of(const std::string& name) { return parse_state_kind(name); }

py::dict counters_dict(const EngineCounters& c) {
  return as_dict(c, field("evictions", &EngineCounters::evictions),
                 field("sync_fetch_waits", &EngineCounters::sync_fetch_waits),
                 field("wait_seconds", &EngineCounters::wait_seconds),
                 field("evicted_bytes", &EngineCounters::evicted_bytes), field("fetches", &EngineCounters::fetches),
                 field("grad_chunks_offloaded", &EngineCounters::grad_chunks_offloaded),
                 field("flushed_chunks", &EngineCounters::flushed_chunks),
                 field("backward_passes", &EngineCounters::backward_passes),
                 field("reclaims", &EngineCounters::reclaims),
                 field("reclaimed_bytes", &EngineCounters::reclaimed_bytes),
                 field("optimizer_wait_seconds", &EngineCounters::optimizer_wait_seconds),
                 field("optimizer_waits", &EngineCounters::optimizer_waits));
}

// Construction, parameters and the hook bodies.
void def_setup_and_hooks(py::class_<GeminiManager>& cls) {
  cls.def(py::init([](PyChunkManager& cm, const py::list& sets, const py::list& params, const std::string& policy) {
             std::vector<ChunkSetSpec> specs;
             for (const auto& item : sets) specs.push_back(set_spec_of(item.cast<py::dict>()));
             std::vector<ParamSpec> ps;
             for (const auto& item : params) {
               auto t = item.cast<py::tuple>();
               ps.push_back(ParamSpec{t[0].cast<ChunkId>(), t[1].cast<size_t>(), t[2].cast<bool>()});
             }
             return std::make_unique<GeminiManager>(cm.ctx, *cm.mgr, std::move(specs), std::move(ps), policy);
           }),
           py::arg("chunk_manager"), py::arg("sets"), py::arg("params"), py::arg("policy"), py::keep_alive<1, 2>())
      .def("param_views", &GeminiManager::param_views, nogil())
      .def("param_binding", &GeminiManager::param_binding, nogil())
      .def("apply_placement", &GeminiManager::apply_placement, nogil())
      .def("register_module", &GeminiManager::register_module, nogil())
      .def("watch_params", &GeminiManager::watch_params, nogil())
      .def("written_params", &GeminiManager::written_params)
      .def("rebound_params", &GeminiManager::rebound_params)
      .def("note_param_versions", &GeminiManager::note_param_versions)
      .def("pre_forward", &GeminiManager::pre_forward, nogil())
      .def("post_forward", &GeminiManager::post_forward, nogil())
      .def("pre_backward", &GeminiManager::pre_backward, nogil())
      .def("post_backward", &GeminiManager::post_backward, nogil())
      .def("post_accumulate_grad", [](GeminiManager& g, int param, at::Tensor p) { g.post_accumulate_grad(param, p); },
           nogil())
      .def("end_backward", &GeminiManager::end_backward, nogil())
      .def("set_no_sync", &GeminiManager::set_no_sync, nogil())
      .def_property_readonly("no_sync", &GeminiManager::no_sync)
      .def_property_readonly("in_backward", &GeminiManager::in_backward)
      .def("begin_generation_trace", &GeminiManager::begin_generation_trace, nogil())
      .def("end_generation_pass", &GeminiManager::end_generation_pass, nogil())
      .def("end_generation_trace", &GeminiManager::end_generation_trace, nogil())
      .def("end_iteration", [](GeminiManager& g) {
        torch_layer::IterationEnd end;
        {
          py::gil_scoped_release release;
          end = g.end_iteration();
        }
        py::dict d;
        d["repeated"] = end.repeated;
        d["counters"] = counters_dict(end.counters);
        d["device_bytes_peak"] = end.device_bytes_peak;
        d["trace_rerecordings"] = end.trace_rerecordings;
        return d;
      });
}

// Residency and placement.
void def_residency(py::class_<GeminiManager>& cls) {
  cls.def("set_async_reduce", &GeminiManager::set_async_reduce)
      .def("set_max_prefetch", &GeminiManager::set_max_prefetch)
      .def("set_device_budget", &GeminiManager::set_device_budget, nogil())
      .def("prefetch_next_forward", &GeminiManager::prefetch_next_forward, nogil())
      .def("hold_params_on_device", &GeminiManager::hold_params_on_device, nogil())
      .def("release_params_on_device", &GeminiManager::release_params_on_device, nogil())
      .def_property_readonly("device_budget", &GeminiManager::device_budget)
      .def("set_optim_on_host", &GeminiManager::set_optim_on_host, nogil())
      .def("set_param_home_on_host", &GeminiManager::set_param_home_on_host, nogil())
      .def("set_placements",
           [](GeminiManager& g) {
             std::vector<SetPlacement> placements;
             {
               py::gil_scoped_release release;
               placements = g.set_placements();
             }
             py::list out;
             for (const auto& p : placements)
               out.append(as_dict(p, field("param_chunk", &SetPlacement::param_chunk),
                                  field("trainable", &SetPlacement::trainable),
                                  field("optim_on_host", &SetPlacement::optim_on_host),
                                  field("param_home_on_host", &SetPlacement::param_home_on_host),
                                  field("keep_gathered", &SetPlacement::keep_gathered),
                                  field("grad_stays_on_device", &SetPlacement::grad_stays_on_device)));
             return out;
           })
      .def("reclaim_device_bytes", &GeminiManager::reclaim_device_bytes, nogil())
      .def("stop_reclaiming", &GeminiManager::stop_reclaiming);
}

// A read without the GIL; the first one served from below an in-place guess warns (once per engine).
template <typename Fn>
auto note_read(GeminiManager& g, Fn&& read) {
  decltype(read()) value;
  bool note = false;
  {
    py::gil_scoped_release release;
    value = read();
    note = g.take_read_before_guess_note();
  }
  if (note && PyErr_WarnEx(PyExc_UserWarning,
                           "gemini_ext: parameters or optimizer state read between backward() and optimizer.step() "
                           "under host_step_speculation='in_place' are the values before the step recomputed from the "
                           "host sets' in-place steps, which stay (the step is unchanged by the read): within a few "
                           "ulps of the exact values. For exact values there, use "
                           "GeminiConfig(host_step_speculation='spares') or 'off'.",
                           1) != 0)
    throw py::error_already_set();
  return value;
}

// Gradients and values (fp32 CPU copies, state dicts, checkpoints).
void def_gradients_and_values(py::class_<GeminiManager>& cls) {
  cls.def("flush_grads", &GeminiManager::flush_grads, nogil())
      .def("zero_grad", &GeminiManager::zero_grad, nogil())
      .def("has_grad", &GeminiManager::has_grad, nogil())
      .def("read_grad",
           [](GeminiManager& g, int param) -> py::object {
             at::Tensor t;
             {
               py::gil_scoped_release release;
               t = g.read_grad(param);
             }
             if (!t.defined()) return py::none();
             return py::cast(t);
           })
      .def("set_replica_communicator",
           [](GeminiManager& g, std::shared_ptr<torch_layer::ProcessGroupCommunicator> comm) {
             g.set_replica_communicator(comm.get());
           },
           py::keep_alive<1, 2>())
      .def("read",
           [](GeminiManager& g, const std::string& kind, int param) {
             const StateKind k = kind_of(kind);
             return note_read(g, [&] { return g.read(k, param); });
           })
      .def("read_to",
           [](GeminiManager& g, const std::string& kind, int param, at::Device target, at::ScalarType scalar_type) {
             const StateKind k = kind_of(kind);
             return note_read(g, [&] { return g.read_to(k, param, target, scalar_type); });
           },
           py::arg("kind"), py::arg("param"), py::arg("device"), py::arg("dtype"))
      .def("read_compute_param_to",
           [](GeminiManager& g, int param, at::Device target, at::ScalarType scalar_type) {
             return note_read(g, [&] { return g.read_compute_param_to(param, target, scalar_type); });
           },
           py::arg("param"), py::arg("device"), py::arg("dtype"))
      .def("read_local",
           [](GeminiManager& g, const std::string& kind, int param) {
             const StateKind k = kind_of(kind);
             return note_read(g, [&] { return g.read_local(k, param); });
           })
      .def("write",
           [](GeminiManager& g, const std::string& kind, int param, const at::Tensor& value) {
             g.write(kind_of(kind), param, value);
           },
           nogil())
      .def("release_read_cache", &GeminiManager::release_read_cache, nogil())
      .def("step_of", &GeminiManager::step_of, nogil())
      .def("set_step", &GeminiManager::set_step, nogil())
      .def("synchronize", &GeminiManager::synchronize, nogil());
}

// Trace, timeline and counters.
void def_observing(py::class_<GeminiManager>& cls) {
  cls.def("trace_info",
           [](GeminiManager& g) {
             std::tuple<std::vector<ChunkId>, int64_t, int64_t, bool> t;
             {
               py::gil_scoped_release release;
               t = g.trace_info();
             }
             py::dict d;
             d["recorded"] = std::get<0>(t);
             d["iterations"] = std::get<1>(t);
             d["rerecordings"] = std::get<2>(t);
             d["usable"] = std::get<3>(t);
             return d;
           })
      .def("trace_diverged", &GeminiManager::trace_diverged, nogil())
      .def("timeline",
           [](GeminiManager& g) {
             std::vector<TimelineEvent> events;
             {
               py::gil_scoped_release release;
               events = g.timeline();
             }
             py::list out;
             for (const auto& e : events)
               out.append(py::make_tuple(e.seconds, std::string(1, e.kind), e.chunk, e.device_bytes));
             return out;
           })
      .def("counters", [](GeminiManager& g) {
        EngineCounters c;
        {
          py::gil_scoped_release release;
          c = g.counters();
        }
        return counters_dict(c);
      });
}

}  // namespace

void bind_manager(py::module_& m) {
  py::class_<GeminiManager> cls(m, "GeminiManager");
  def_setup_and_hooks(cls);
  def_residency(cls);
  def_gradients_and_values(cls);
  def_observing(cls);
}

}  // namespace gx::bindings
