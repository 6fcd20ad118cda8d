"""The fixed placements: `static` and `const`.

- `static`: fixed fractions in exact bytes of chunks (core/static_placement.*): `offload_optim_frac`
  selects chunks from the *back* of the execution order (their gradients are complete first in
  backward, so CPU Adam on them has the most time), `offload_param_frac` from the *front* (used
  first in forward, needed last in backward: the longest time a host copy is enough).
  `gpu_memory_limit` (or the whole device) caps chunks *and* torch's allocations together: the first
  iteration runs with the whole limit as chunk budget; at its end, on cuda, the chunk budget becomes
  the limit less what the iteration needed besides chunks (the Note on safety margins in base.py;
  never below three of the largest chunks), so activations are planned for as under `auto`. The
  fractions are not changed by it: what does not fit is evicted as under `const`. On sim,
  activations live on the host and the budget stays the whole capacity.
- `const`: the static fractions, with chunks capped at `const_gpu_budget` bytes on the device; what
  does not fit is evicted (farthest next use once a trace exists, LRU before).
"""

from __future__ import annotations

from .base import Measurements, Placement, PlacementPolicy, budget_decision, measured_chunk_budget, register


@register
class StaticPolicy(PlacementPolicy):
    name = "static"

    def decides_after_iterations(self, device_kind: str) -> bool:
        return device_kind == "cuda"  # on sim, activations live on the host

    def after_iteration(self, m: Measurements, current: Placement) -> Placement:
        # Plan for the activations just measured: the fractions stay, what does not fit is evicted.
        budget, warnings = measured_chunk_budget(m, self.name)
        return Placement(current.sets, budget, budget_decision(m, budget, current), tuple(warnings))


@register
class ConstPolicy(PlacementPolicy):
    name = "const"

    def __init__(self, config):
        super().__init__(config)
        if config.const_gpu_budget is None:
            raise ValueError("placement_policy='const' needs const_gpu_budget (bytes or a string such as '8GiB'): "
                             "the constant device budget for chunks.")

    def warm_up_budget(self, m: Measurements) -> int:
        return int(self.config.const_gpu_budget)
