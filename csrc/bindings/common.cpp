#include "bindings/common.h"

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

}  // namespace gx::bindings
