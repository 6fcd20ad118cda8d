// Stat: one memory statistic {current, peak, allocated, freed} in bytes, updated in one place.
//
// Design note: every byte counter of the project (per tier in the ChunkManager, per resource
// in the statistics adaptor, per pool) is a Stat. `current` can never go negative: a decrease
// larger than `current` is an accounting bug and throws InternalError instead of wrapping.
// `allocated` and `freed` are monotone totals, so allocated - freed == current always holds.
#pragma once

#include <cstdint>

#include "errors.h"

namespace gx {

struct Stat {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocated = 0;
  int64_t freed = 0;

  void increase(int64_t bytes) {
    GX_INTERNAL_ASSERT(bytes >= 0, "Stat::increase by negative bytes ", bytes);
    current += bytes;
    allocated += bytes;
    if (current > peak) peak = current;
  }
  void decrease(int64_t bytes) {
    GX_INTERNAL_ASSERT(bytes >= 0, "Stat::decrease by negative bytes ", bytes);
    GX_INTERNAL_ASSERT(bytes <= current, "Stat would go negative: current ", current, " bytes, decrease by ",
                       bytes);
    current -= bytes;
    freed += bytes;
  }
  void reset_peak() { peak = current; }
};

}  // namespace gx
