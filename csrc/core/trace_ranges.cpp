#include "core/trace_ranges.h"

namespace gx {

TraceRanges& TraceRanges::none() {
  static auto* nothing = new TraceRanges();  // never destroyed: components may outlive static destruction
  return *nothing;
}

}  // namespace gx
