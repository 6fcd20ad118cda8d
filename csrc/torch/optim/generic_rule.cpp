// The generic rule: any torch.optim.Optimizer, stepped by the optimizer itself over views into
// the chunks (gemini_ext/optim/generic.py builds the views and calls it). It declares no state
// chunks: the torch optimizer allocates its state beside the masters, on their tier.
#include "core/errors.h"
#include "torch/optim/optimizer_rule.h"

namespace gx::torch_layer {

namespace {

class GenericRule final : public OptimizerRule {
 public:
  explicit GenericRule(WholeSetStep step_set) : step_set_(std::move(step_set)) {}

  const std::vector<StateKind>& state_kinds() const override { return kinds_; }

  std::function<void()> prepare_host_run(const RunViews&, const RunSpares*, int64_t, const HyperValues&,
                                         double) const override {
    GX_INTERNAL_ASSERT(false, "the generic rule steps whole sets, never runs");
  }

  bool device_run(const RunViews&, int64_t, const HyperValues&, double) const override {
    GX_INTERNAL_ASSERT(false, "the generic rule steps whole sets, never runs");
  }

  bool steps_whole_sets() const override { return true; }

  void step_whole_set(int set_index, const RunViews& set, const std::vector<int>& params,
                      double grad_multiplier) const override {
    step_set_(set_index, set.master, set.grad, params, grad_multiplier);
  }

 private:
  WholeSetStep step_set_;
  std::vector<StateKind> kinds_;
};

}  // namespace

std::unique_ptr<OptimizerRule> make_generic_rule(WholeSetStep step_set) {
  GX_CHECK(static_cast<bool>(step_set), "generic optimizer rule: a step function is required.");
  return std::make_unique<GenericRule>(std::move(step_set));
}

}  // namespace gx::torch_layer
