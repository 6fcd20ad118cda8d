#include "torch/optim/optimizer_rule.h"

#include "core/errors.h"

namespace gx::torch_layer {

std::unique_ptr<OptimizerRule> make_adam_rule();                                 // adam_rule.cpp
std::unique_ptr<OptimizerRule> make_cpu_optim_rule(const std::string& name, bool sgd_momentum);  // cpu_optim_rules.cpp

std::unique_ptr<OptimizerRule> make_optimizer_rule(const std::string& name, const std::vector<StateKind>& kinds) {
  std::unique_ptr<OptimizerRule> rule;
  if (name == "adam") {
    rule = make_adam_rule();
  } else if (name == "sgd" || name == "lion" || name == "adagrad") {
    rule = make_cpu_optim_rule(name, !kinds.empty());
  } else {
    GX_CHECK(false, "optimizer rule: expected 'adam', 'sgd', 'lion' or 'adagrad', got '", name, "'.");
  }
  auto names = [](const std::vector<StateKind>& ks) {
    std::string out;
    for (StateKind k : ks) out += std::string(out.empty() ? "" : ", ") + state_kind_name(k);
    return "[" + out + "]";
  };
  GX_CHECK(rule->state_kinds() == kinds, "optimizer rule '", name, "': state kinds ", names(kinds),
           " were declared, the rule steps ", names(rule->state_kinds()), ".");
  return rule;
}

void OptimizerRule::step_whole_set(int, const RunViews&, const std::vector<int>&, double) const {
  GX_INTERNAL_ASSERT(false, "step_whole_set on a rule that steps runs");
}

std::function<void()> OptimizerRule::prepare_host_correction(const RunViews&, int64_t, const HyperValues&, double,
                                                             double) const {
  GX_INTERNAL_ASSERT(false, "prepare_host_correction on a rule that does not correct in place");
  return nullptr;
}

std::function<void()> OptimizerRule::prepare_host_undo(const RunViews&, int64_t, const HyperValues&, double) const {
  GX_INTERNAL_ASSERT(false, "prepare_host_undo on a rule that does not correct in place");
  return nullptr;
}

double hyper_value(const HyperValues& hyper, const char* key, const char* rule) {
  auto it = hyper.find(key);
  GX_CHECK(it != hyper.end(), "optimizer rule '", rule, "': the hyperparameters of a group lack '", key, "'.");
  return it->second;
}

}  // namespace gx::torch_layer
