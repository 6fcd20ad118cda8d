// gemini_ext._C, core: tensor states, the static placement and chunk search functions, device
// contexts, process-group communicators and the ChunkManager (groups, copies, moves, views,
// pools, traffic).
#include <tuple>

#include "bindings/common.h"
#include "core/activation_plan.h"
#include "core/chunk_search.h"
#include "core/static_placement.h"
#include "torch/chunk_views.h"
#include "torch/dtype_map.h"
#include "torch/host_buffer_pool.h"
#include "torch/pg_communicator.h"

namespace gx::bindings {

Tier parse_tier(const std::string& name) {
  for (Tier t : {Tier::kDevice, Tier::kPinnedHost, Tier::kPageableHost})
    if (name == to_string(t)) return t;
  if (name == "host") return Tier::kPageableHost;
  GX_CHECK(false, "tier: expected 'device', 'pinned_host' or 'pageable_host', got '", name, "'.");
}

py::dict stat_dict(const Stat& s) {
  return as_dict(s, field("current", &Stat::current), field("peak", &Stat::peak), field("allocated", &Stat::allocated),
                 field("freed", &Stat::freed));
}

using torch_layer::DeviceContext;
using torch_layer::DeviceOptions;

namespace {
TensorHandle handle_of(const py::tuple& t) {
  GX_CHECK(t.size() == 2, "tensor handle: expected (chunk_id, slot_index), got a tuple of ", t.size(), ".");
  return TensorHandle{t[0].cast<ChunkId>(), t[1].cast<size_t>()};
}
}  // namespace

namespace {
// Groups, registration, allocation and moves.
void def_layout_and_moves(py::class_<PyChunkManager>& cls) {
  cls.def(py::init([](std::shared_ptr<DeviceContext> ctx, int world_size, int rank, size_t alignment_bytes,
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
           [](PyChunkManager& p, const std::string& group, at::ScalarType scalar_type, int64_t chunk_size_numel,
              const std::string& home_tier, int64_t alignment_numel) {
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
      .def_property_readonly("world_size", [](PyChunkManager& p) { return p.mgr->world_size(); });
}

// Tensor states and views.
void def_states_and_views(py::class_<PyChunkManager>& cls) {
  cls.def("in_flight", [](PyChunkManager& p, ChunkId id) { return p.mgr->in_flight(id); })
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
           });
}

// Layout, bytes, pools and traffic.
void def_stats(py::class_<PyChunkManager>& cls) {
  cls.def("chunk_info",
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
      .def("tier_bytes",
           [](PyChunkManager& p, const std::string& tier) { return stat_dict(p.mgr->tier_bytes(parse_tier(tier))); })
      .def("reserved_bytes",
           [](PyChunkManager& p, const std::string& tier) {
             return stat_dict(p.mgr->allocator().reserved_bytes(parse_tier(tier)));
           })
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
      .def(
          "trim", [](PyChunkManager& p, const std::string& tier) { return p.mgr->trim(parse_tier(tier)); },
          py::call_guard<py::gil_scoped_release>())
      .def("reserve_arena", [](PyChunkManager& p, const std::string& tier,
                               size_t bytes) { p.mgr->reserve_arena(parse_tier(tier), bytes); })
      .def("wasted_bytes", [](PyChunkManager& p) { return p.mgr->wasted_bytes(); })
      .def("traffic", [](PyChunkManager& p) {
        return as_dict(p.mgr->traffic(),
                       field("h2d_bytes", &TrafficStats::h2d_bytes),
                       field("d2h_bytes", &TrafficStats::d2h_bytes),
                       field("h2h_bytes", &TrafficStats::h2h_bytes),
                       field("moves", &TrafficStats::moves),
                       field("fetches", &TrafficStats::fetches),
                       field("accesses", &TrafficStats::accesses),
                       field("all_gathers", &TrafficStats::all_gathers),
                       field("reduce_scatters", &TrafficStats::reduce_scatters),
                       field("gather_prefetches", &TrafficStats::gather_prefetches),
                       field("reductions", &TrafficStats::reductions),
                       field("prefetches", &TrafficStats::prefetches),
                       field("prefetch_hits", &TrafficStats::prefetch_hits),
                       field("prefetch_wasted", &TrafficStats::prefetch_wasted),
                       field("copy_wait_seconds", &TrafficStats::copy_wait_seconds),
                       field("copy_waits", &TrafficStats::copy_waits));
      });
}

void bind_chunk_manager(py::module_& m) {
  py::class_<PyChunkManager> cls(m, "ChunkManager");
  def_layout_and_moves(cls);
  def_states_and_views(cls);
  def_stats(cls);
}

// core/activation_plan.h: the per-block choice of keeping, recomputing or offloading activations.
using BlockCostTuple = std::tuple<int64_t, int64_t, double, double>;

ActivationPlanInputs plan_inputs(const std::vector<BlockCostTuple>& blocks, int64_t device_free_bytes,
                                 double link_bytes_per_second, int in_flight) {
  ActivationPlanInputs in;
  for (const auto& [activation, input, forward, backward] : blocks)
    in.blocks.push_back(BlockCosts{activation, input, forward, backward});
  in.device_free_bytes = device_free_bytes;
  in.link_bytes_per_second = link_bytes_per_second;
  in.in_flight = in_flight;
  return in;
}

BlockActivations parse_block_activations(const std::string& name) {
  for (BlockActivations c : {BlockActivations::kKeep, BlockActivations::kRecompute, BlockActivations::kOffload})
    if (name == to_string(c)) return c;
  GX_CHECK(false, "block activations: expected 'keep', 'recompute' or 'offload', got '", name, "'.");
}

void def_activation_plan(py::module_& m) {
  m.def(
      "activation_device_bytes",
      [](const std::vector<BlockCostTuple>& blocks, const std::vector<std::string>& choices, int in_flight) {
        std::vector<BlockActivations> parsed;
        for (const std::string& c : choices) parsed.push_back(parse_block_activations(c));
        return activation_device_bytes(plan_inputs(blocks, 0, 0, in_flight), parsed);
      },
      py::arg("blocks"), py::arg("choices"), py::arg("in_flight") = 2,
      "The device bytes of given per-block choices (core/activation_plan.h's cost model).");
  m.def(
      "plan_activations",
      [](const std::vector<BlockCostTuple>& blocks, int64_t device_free_bytes, double link_bytes_per_second,
         int in_flight, bool allow_keep, bool allow_recompute, int64_t host_free_bytes) {
        ActivationPlanInputs in = plan_inputs(blocks, device_free_bytes, link_bytes_per_second, in_flight);
        in.allow_keep = allow_keep;
        in.allow_recompute = allow_recompute;
        in.host_free_bytes = host_free_bytes;
        const ActivationPlan plan = plan_activations(in);
        py::list choices;
        for (BlockActivations c : plan.choices) choices.append(py::str(to_string(c)));
        py::dict out;
        out["choices"] = choices;
        out["device_bytes"] = plan.device_bytes;
        out["added_seconds"] = plan.added_seconds;
        out["fits"] = plan.fits;
        out["host_bytes"] = plan.host_bytes;
        return out;
      },
      py::arg("blocks"), py::arg("device_free_bytes"), py::arg("link_bytes_per_second"), py::arg("in_flight") = 2,
      py::arg("allow_keep") = true, py::arg("allow_recompute") = true, py::arg("host_free_bytes") = -1,
      "Per block ('keep', 'recompute' or 'offload') from (activation_bytes, input_bytes, forward_seconds, "
      "backward_seconds) in forward order; see core/activation_plan.h.");
}

// The host memory offloaded activations live in (csrc/torch/host_buffer_pool.h).
void def_host_buffer_pool(py::module_& m) {
  py::class_<torch_layer::HostBufferPool, std::shared_ptr<torch_layer::HostBufferPool>>(m, "HostBufferPool")
      .def(py::init<std::shared_ptr<DeviceContext>>(), py::arg("context"))
      .def("buffer", &torch_layer::HostBufferPool::buffer, py::arg("bytes"), py::arg("streams"),
           "A uint8 CPU tensor of `bytes` from the host memory resource (page-locked on cuda, never shared with "
           "forked children), reused by event on `streams` (raw CUDA streams; [] on sim); OutOfMemoryError where "
           "the host cannot hold it.")
      .def("has_free_slot", &torch_layer::HostBufferPool::has_free_slot, py::arg("bytes"))
      .def("release_free", &torch_layer::HostBufferPool::release_free, py::call_guard<py::gil_scoped_release>())
      .def("stats", [](const torch_layer::HostBufferPool& p) {
        const Stat in_use = p.pool().in_use_bytes();
        py::dict d;
        d["in_use_bytes"] = in_use.current;
        d["peak_in_use_bytes"] = in_use.peak;
        d["reserved_bytes"] = p.pool().reserved_bytes();
        d["upstream_allocations"] = p.pool().upstream_allocations();
        d["ordered_reuses"] = p.pool().ordered_reuses();
        return d;
      });
}

}  // namespace

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

  def_activation_plan(m);

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
        return as_dict(r,
                       field("chunk_size_numel", &ChunkSearchResult::chunk_size_numel),
                       field("wasted_numel", &ChunkSearchResult::wasted_numel),
                       field("num_chunks", &ChunkSearchResult::num_chunks),
                       field("total_numel", &ChunkSearchResult::total_numel),
                       field("exlarge_indices", &ChunkSearchResult::exlarge_indices),
                       field("candidates", &ChunkSearchResult::candidates));
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
      .def_property_readonly("host_memory_is_pinned",
                             [](DeviceContext& c) { return c.backend().host_memory_is_pinned(); })
      .def("torch_device", [](DeviceContext& c) { return py::str(c.device_for(Tier::kDevice).str()); })
      .def(
          "synchronize", [](DeviceContext& c) { c.backend().synchronize_all(); },
          py::call_guard<py::gil_scoped_release>());

  def_host_buffer_pool(m);

  py::class_<torch_layer::ProcessGroupCommunicator, std::shared_ptr<torch_layer::ProcessGroupCommunicator>>(
      m, "ProcessGroupCommunicator")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>, std::shared_ptr<DeviceContext>>(),
           py::arg("process_group"), py::arg("context"))
      .def_property_readonly("world_size", &torch_layer::ProcessGroupCommunicator::world_size)
      .def_property_readonly("rank", &torch_layer::ProcessGroupCommunicator::rank)
      .def_property_readonly("name", &torch_layer::ProcessGroupCommunicator::name)
      .def_property_readonly("calls", &torch_layer::ProcessGroupCommunicator::calls);

  bind_chunk_manager(m);
}

}  // namespace gx::bindings
