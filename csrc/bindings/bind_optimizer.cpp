// gemini_ext._C, optimizer: the CPU kernels, the state kinds, and the GeminiManager's optimizer
// entry points (the generic set stepping with a rule: torch/optim/hybrid_optimizer.h).
#include <array>
#include <string>

#include "bindings/common.h"
#include "core/kernels/adam_correction.h"
#include "torch/optim/cpu_adam_op.h"
#include "torch/optim/cpu_optim_op.h"
#include "torch/manager/manager.h"
#include "torch/optim/device_adam_op.h"
#include "torch/mapped_view.h"

namespace gx::bindings {

using torch_layer::GeminiManager;
using torch_layer::HyperValues;
using torch_layer::StepStats;
using nogil = py::call_guard<py::gil_scoped_release>;

namespace {

// A native rule by name with its state kinds, or the generic rule calling `step_set` (a Python
// function, called and released with the GIL held) for each chunk set.
void attach_optimizer(GeminiManager& g, const std::string& rule, const std::vector<std::string>& kinds,
                      std::vector<int> group_of_param, const std::vector<std::vector<ChunkId>>& state_chunks,
                      std::optional<py::function> step_set) {
  std::unique_ptr<torch_layer::OptimizerRule> r;
  if (rule == "generic") {
    GX_CHECK(step_set.has_value(), "attach_optimizer('generic'): step_set is required.");
    std::shared_ptr<py::function> fn(new py::function(*step_set), [](py::function* f) {
      py::gil_scoped_acquire gil;
      delete f;
    });
    r = torch_layer::make_generic_rule([fn](int s, const at::Tensor& master, const at::Tensor& grad,
                                            const std::vector<int>& params, double multiplier) {
      py::gil_scoped_acquire gil;
      (*fn)(s, master, grad, params, multiplier);
    });
  } else {
    std::vector<StateKind> parsed;
    for (const auto& k : kinds) parsed.push_back(parse_state_kind(k));
    r = torch_layer::make_optimizer_rule(rule, parsed);
  }
  py::gil_scoped_release release;
  g.attach_optimizer(std::move(r), std::move(group_of_param), state_chunks);
}

}  // namespace

namespace {

void device_adam_step(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                      const at::Tensor& grad, const std::optional<at::Tensor>& param16, int64_t step, double lr,
                      double beta1, double beta2, double eps, double weight_decay, bool adamw, double grad_scale,
                      int64_t random_key, int64_t first_index, int max_blocks) {
  GX_CHECK(random_key >= 0 && random_key <= UINT32_MAX && first_index >= 0 && first_index <= UINT32_MAX,
           "device_adam_step: random_key and first_index must be in [0, 2^32), got ", random_key, " and ",
           first_index, ".");
  torch_layer::device_adam_step(
      param, exp_avg, exp_avg_sq, grad, param16,
      torch_layer::adam_hyper_of(step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale),
      static_cast<uint32_t>(random_key), static_cast<uint32_t>(first_index), max_blocks);
}

// The Adam step cpu_adam_step took in place with `taken_scale`: corrected to `true_scale`, or undone.
void cpu_adam_correct(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                      const at::Tensor& grad, const std::optional<at::Tensor>& param16, int64_t step, double lr,
                      double beta1, double beta2, double eps, double weight_decay, bool adamw, double taken_scale,
                      std::optional<double> true_scale) {
  const torch_layer::CpuAdamWork w = torch_layer::prepare_cpu_adam(
      param, exp_avg, exp_avg_sq, grad, param16,
      torch_layer::adam_hyper_of(step, lr, beta1, beta2, eps, weight_decay, adamw, taken_scale));
  GX_CHECK(!w.moments.has_value(), "cpu_adam_correct: fp32 moments only (bf16 moments are rounded "
           "stochastically, which a correction cannot reproduce).");
  if (true_scale.has_value()) {
    adam_correct_step(w.hyper, *true_scale, w.buffers);
  } else {
    adam_undo_step(w.hyper, w.buffers);
  }
}

}  // namespace

namespace {

// The GeminiManager's optimizer entry points.
void def_manager_optimizer(py::module_& m) {
  // Hyperparameters arrive as one dict of floats per parameter group (the Python rule writes them).
  auto cls = py::reinterpret_borrow<py::class_<GeminiManager>>(m.attr("GeminiManager"));
  // The optimizer's own queries go through with_optimizer (the manager's lock, one call each).
  using torch_layer::HybridOptimizer;
  cls.def("attach_optimizer", &attach_optimizer, py::arg("rule"), py::arg("kinds"), py::arg("group_of_param"),
          py::arg("state_chunks"), py::arg("step_set") = std::nullopt)
      .def("grad_norm_sq", &GeminiManager::grad_norm_sq, nogil())
      .def("optimizer_step", &GeminiManager::optimizer_step, py::arg("groups"), py::arg("grad_multiplier"), nogil())
      .def("set_link_sets",
           [](GeminiManager& g, const std::vector<int>& sets) {
             g.with_optimizer([&](HybridOptimizer& o) { o.set_link_sets(sets); });
           },
           py::arg("sets"), nogil())
      .def("link_sets",
           [](GeminiManager& g) { return g.with_optimizer([](HybridOptimizer& o) { return o.link_sets(); }); },
           nogil())
      .def("last_step",
           [](GeminiManager& g) {
             StepStats s;
             {
               py::gil_scoped_release release;
               s = g.with_optimizer([](HybridOptimizer& o) { return o.last_step(); });
             }
             return as_dict(s, field("host_params", &StepStats::host_params),
                            field("device_params", &StepStats::device_params),
                            field("host_seconds", &StepStats::host_seconds),
                            field("link_params", &StepStats::link_params),
                            field("link_seconds", &StepStats::link_seconds),
                            field("launch_seconds", &StepStats::launch_seconds),
                            field("device_seconds", &StepStats::device_seconds),
                            field("pending_sets", &StepStats::pending_sets),
                            field("guessed_sets", &StepStats::guessed_sets),
                            field("corrected_sets", &StepStats::corrected_sets),
                            field("redone_sets", &StepStats::redone_sets),
                            field("skipped_sets", &StepStats::skipped_sets),
                            field("correction_seconds", &StepStats::correction_seconds));
           });
}

// The host steps started during backward: speculation (spares or in place) and the step in backward.
void def_manager_speculation(py::module_& m) {
  auto cls = py::reinterpret_borrow<py::class_<GeminiManager>>(m.attr("GeminiManager"));
  using torch_layer::HybridOptimizer;
  cls.def("backward_started",
           [](GeminiManager& g, const std::vector<HyperValues>& groups, const std::string& host_steps,
              const std::string& optimizer_name, bool rule_native, bool loss_scaled, double max_norm,
              bool user_clipped_last, std::optional<double> last_norm, bool placement_decides_now,
              std::optional<int64_t> host_available_bytes) {
             EarlyStepFacts facts;
             facts.configured = host_steps_from(host_steps);
             facts.optimizer_name = optimizer_name;
             facts.rule_native = rule_native;
             facts.loss_scaled = loss_scaled;
             facts.max_norm = max_norm;
             facts.user_clipped_last = user_clipped_last;
             facts.last_norm = last_norm;
             facts.placement_decides_now = placement_decides_now;
             facts.host_available_bytes = host_available_bytes;
             EarlyStepDecision d;
             {
               py::gil_scoped_release release;
               d = g.with_optimizer([&](HybridOptimizer& o) { return o.backward_started(groups, facts); });
             }
             py::dict out;
             out["mode"] = to_string(d.mode);
             out["cover"] = to_string(d.cover);
             out["reason"] = d.reason;
             out["planned_cover"] = d.planned_cover ? py::object(py::str(to_string(*d.planned_cover))) : py::none();
             return out;
           },
           py::arg("groups"), py::arg("host_steps"), py::arg("optimizer_name"), py::arg("rule_native"),
           py::arg("loss_scaled"), py::arg("max_norm"), py::arg("user_clipped_last"), py::arg("last_norm"),
           py::arg("placement_decides_now"), py::arg("host_available_bytes"))
      .def("sets_stepped_in_backward",
           [](GeminiManager& g) {
             return g.with_optimizer([](HybridOptimizer& o) { return o.sets_stepped_in_backward(); });
           },
           nogil())
      .def("spare_bytes",
           [](GeminiManager& g) { return g.with_optimizer([](HybridOptimizer& o) { return o.spare_bytes(); }); },
           nogil())
      .def("spare_bytes_needed",
           [](GeminiManager& g) { return g.with_optimizer([](HybridOptimizer& o) { return o.spare_bytes_needed(); }); },
           nogil())
      .def("release_spares",
           [](GeminiManager& g) { g.with_optimizer([](HybridOptimizer& o) { o.release_spares(); }); }, nogil())
      .def("speculations",
           [](GeminiManager& g) {
             std::pair<int64_t, int64_t> counts;
             {
               py::gil_scoped_release release;
               counts = g.with_optimizer([](HybridOptimizer& o) {
                 return std::pair<int64_t, int64_t>{o.speculations_confirmed(), o.speculations_dropped()};
               });
             }
             py::dict d;
             d["confirmed"] = counts.first;
             d["dropped"] = counts.second;
             return d;
           });
}

// The early-step policy's memory (core/early_step.h) and the in-place guesses' counts.
void def_manager_guesses(py::module_& m) {
  auto cls = py::reinterpret_borrow<py::class_<GeminiManager>>(m.attr("GeminiManager"));
  using torch_layer::HybridOptimizer;
  cls.def("guess_supported",  // whether host_steps="in_place" guesses (else it takes spares)
          [](GeminiManager& g) { return g.with_optimizer([](HybridOptimizer& o) { return o.guess_supported(); }); },
          nogil())
      .def("speculation_memory",
           [](GeminiManager& g) {
             EarlyStepPolicy::Memory mem;
             {
               py::gil_scoped_release release;
               mem = g.with_optimizer([](HybridOptimizer& o) { return o.early_step_policy().memory(); });
             }
             py::dict d;
             d["backwards_per_step"] = mem.backwards_per_step;
             d["last_step_scaled"] = mem.last_step_scaled;
             return d;
           })
      .def("restore_speculation_memory",
           [](GeminiManager& g, int64_t backwards_per_step, bool last_step_scaled) {
             g.with_optimizer([&](HybridOptimizer& o) {
               o.early_step_policy().restore({backwards_per_step, last_step_scaled});
             });
           },
           py::arg("backwards_per_step"), py::arg("last_step_scaled"), nogil())
      .def("guess_counts",
           [](GeminiManager& g) {
             std::array<int64_t, 7> c{};
             {
               py::gil_scoped_release release;
               c = g.with_optimizer([](HybridOptimizer& o) {
                 const EarlyStepPolicy& p = o.early_step_policy();
                 return std::array<int64_t, 7>{p.steps_taken(),        p.steps_scaled(),      o.guesses_undone(),
                                               p.backwards_expected(), o.guesses_judged(), o.guesses_corrected(),
                                               o.reads_before_guesses()};
               });
             }
             py::dict d;
             d["steps"] = c[0];
             d["steps_clipped"] = c[1];
             d["undone"] = c[2];
             d["backwards_per_step"] = c[3];
             d["guessed"] = c[4];    // sets stepped in place during backward and judged at step()
             d["corrected"] = c[5];  // of those, corrected (clipping) or undone and redone (hyperparameters)
             d["reads_before_guesses"] = c[6];  // reads served from values recomputed below a guess
             return d;
           });
}

// The optimizer pipeline's controls (the CPU steps in flight).
void def_manager_pipeline(py::module_& m) {
  auto cls = py::reinterpret_borrow<py::class_<GeminiManager>>(m.attr("GeminiManager"));
  cls.def("pending_steps", &GeminiManager::pending_steps, nogil())
      .def("settle_all", &GeminiManager::settle_all, nogil())
      .def("set_overlap_optimizer", &GeminiManager::set_overlap_optimizer)
      .def("hold_optimizer_thread", &GeminiManager::hold_optimizer_thread)
      .def("set_optimizer_task_delay_us", &GeminiManager::set_optimizer_task_delay_us);
}

}  // namespace

void bind_optimizer(py::module_& m) {
  py::enum_<StateKind>(m, "StateKind")
      .value("param", StateKind::kParam)
      .value("exp_avg", StateKind::kExpAvg)
      .value("exp_avg_sq", StateKind::kExpAvgSq)
      .value("momentum_buffer", StateKind::kMomentumBuffer)
      .value("sum", StateKind::kSum);

  m.def("cpu_adam_step", &torch_layer::cpu_adam_step, py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("grad"), py::arg("param16") = std::nullopt, py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw") = true,
        py::arg("grad_scale") = 1.0, py::arg("isa") = "", py::arg("out") = std::nullopt,
        py::arg("random_key") = 0, py::arg("first_index") = 0, py::call_guard<py::gil_scoped_release>(),
        "Fused CPU Adam/AdamW over one chunk's fp32 master, m, v and gradient (see csrc/core/kernels/cpu_adam.h); "
        "out=(param_out, exp_avg_out, exp_avg_sq_out) writes the results there and leaves the inputs. m and v "
        "may both be bfloat16: they are then stochastically rounded with the bits of (random_key, "
        "first_index + i) (csrc/core/kernels/cpu_adam_bf16_moments.h).");

  m.def("cpu_adam_correct", &cpu_adam_correct, py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("grad"), py::arg("param16") = std::nullopt, py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw") = true,
        py::arg("taken_scale") = 1.0, py::arg("true_scale") = std::nullopt, nogil(),
        "The Adam step cpu_adam_step took in place with grad_scale=taken_scale, corrected to true_scale, or "
        "undone when true_scale is None (csrc/core/kernels/adam_correction.h).");

  m.def("cpu_optim_step", &torch_layer::cpu_optim_step, py::arg("name"), py::arg("param"), py::arg("states"),
        py::arg("grad"), py::arg("param16") = std::nullopt, py::arg("step"), py::arg("hyper"),
        py::arg("grad_scale") = 1.0, py::arg("isa") = "", py::arg("out") = std::nullopt, nogil(),
        "Fused CPU SGD, Lion or Adagrad (name 'sgd', 'lion', 'adagrad') over one chunk's fp32 master, its "
        "state and gradient (see csrc/core/kernels/cpu_optim.h); hyper: the group's values as the rule names them; "
        "out=(param_out, state_outs...) writes the results there and leaves the inputs.");

  m.def("device_adam_step", &device_adam_step, py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("grad"), py::arg("param16") = std::nullopt, py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw") = true,
        py::arg("grad_scale") = 1.0, py::arg("random_key") = 0, py::arg("first_index") = 0,
        py::arg("max_blocks") = 0, nogil(),
        "The device Adam/AdamW kernel (csrc/cuda/adam_kernel.h) on CUDA tensors, in place, on the current "
        "stream: the same arguments and the same bits as cpu_adam_step.");

  m.attr("LINK_LANE_BLOCKS") = torch_layer::kLinkLaneBlocks;
  m.def("mapped_device_view", &torch_layer::mapped_device_view, py::arg("host"), py::arg("device"),
        "A CUDA tensor over a pinned CPU tensor's memory: kernels on it read and write the host memory "
        "in place over the link (keeps the host tensor alive).");

  def_manager_optimizer(m);
  def_manager_speculation(m);
  def_manager_guesses(m);
  def_manager_pipeline(m);
}

}  // namespace gx::bindings
