#include "stochastic_round.h"

#include <algorithm>

#include "thread_pool.h"

namespace gx {

void narrow_to_bf16_stochastic(const float* x, uint16_t* out, int64_t n, uint32_t key, uint32_t first_index) {
  constexpr int64_t kGrainNumel = int64_t{1} << 16;
  ThreadPool::global().parallel_for(n, kGrainNumel, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t index = first_index + static_cast<uint32_t>(i);
      out[i] = float_to_bf16_stochastic(x[i], stochastic_bits(key, index));
    }
  });
}

}  // namespace gx
