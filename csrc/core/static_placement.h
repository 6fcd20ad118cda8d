// StaticPlacement: the `static` policy's decision, a pure function of chunk sizes and fractions.
//
// Design note. Input: the chunks of trainable parameters in execution order (registration order,
// which follows the model's definition and so, for sequential models, its forward order), with
// their bytes. Each fraction selects chunks by exact bytes: chunks are taken one by one while the
// selected bytes stay within fraction * total bytes (so 0.5 of three equal chunks selects one,
// 1.0 selects all, 0.0 none). Same inputs, same decision, on every rank.
//  * offload_param_frac picks from the *front* of the forward order: the chunks used first in
//    forward are needed last in backward, the longest gap in which a host copy is enough.
//  * offload_optim_frac picks from the *back*: those chunks' gradients are complete first in
//    backward, so a CPU optimizer step on them has the most time to overlap with the rest of
//    backward; the chunks whose gradients arrive last keep their state on the device, where
//    the step is fast.
#pragma once

#include <cstdint>
#include <vector>

namespace gx {

struct StaticFractions {
  double offload_param_frac = 0.0;
  double offload_optim_frac = 1.0;
};

struct ChunkPlacement {
  bool param_home_on_host = false;  // the 16-bit parameter chunk lives on the host between uses
  bool optim_on_host = false;       // fp32 master, m, v on the host, stepped by CPU Adam
};

std::vector<ChunkPlacement> static_placement(const std::vector<int64_t>& chunk_bytes, const StaticFractions& fractions);

// The chunks selected by `fraction` of the bytes, walking from the front or the back.
std::vector<bool> select_by_bytes(const std::vector<int64_t>& chunk_bytes, double fraction, bool from_back);

}  // namespace gx
