// gemini_ext._C, core: tensor states, the static placement and chunk search functions, device
// contexts and process-group communicators.
#include "bindings/common.h"
#include "core/chunk_search.h"
#include "core/static_placement.h"
#include "torch/pg_communicator.h"

namespace gx::bindings {

using torch_layer::DeviceContext;
using torch_layer::DeviceOptions;

void bind_core(py::module_& m) {
  py::enum_<TensorState>(m, "TensorState")
      .value("FREE", TensorState::kFree)
      .value("COMPUTE", TensorState::kCompute)
      .value("HOLD", TensorState::kHold)
      .value("HOLD_AFTER_BWD", TensorState::kHoldAfterBwd)
      .value("READY_FOR_REDUCE", TensorState::kReadyForReduce);
  m.def("is_legal_transition", &is_legal_transition);

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

}

}  // namespace gx::bindings
