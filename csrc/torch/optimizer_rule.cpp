#include "torch/optimizer_rule.h"

#include "core/errors.h"

namespace gx::torch_layer {

std::unique_ptr<OptimizerRule> make_adam_rule();  // adam_rule.cpp

std::unique_ptr<OptimizerRule> make_optimizer_rule(const std::string& name) {
  if (name == "adam") return make_adam_rule();
  GX_CHECK(false, "optimizer rule: expected 'adam', got '", name, "'.");
}

double hyper_value(const HyperValues& hyper, const char* key, const char* rule) {
  auto it = hyper.find(key);
  GX_CHECK(it != hyper.end(), "optimizer rule '", rule, "': the hyperparameters of a group lack '", key, "'.");
  return it->second;
}

}  // namespace gx::torch_layer
