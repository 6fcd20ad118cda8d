"""What every placement policy shares: the measurements it decides from, the placement it returns,
the registry, the interface and the chunk budget from a measured iteration.

A policy is called twice over: `initial(m)` before any memory is taken (the chunk layout is
known), and `after_iteration(m, current)` at each iteration's end when `decides_after_iterations`
holds. Each returns a `Placement`: per chunk set, where its optimizer state lives, its parameter
chunk's home, whether it stays gathered, whether its gradient stays on the device; and the
device budget for chunks. The engine (gemini_ext/placement/placer.py) gathers the `Measurements`
(doing the collectives, so every rank decides alike), calls the policy, and applies the
difference through the C++ GeminiManager. A policy moves nothing and keeps no state of its own:
what it needs from the past comes in `current`. Adding a policy means adding a file to this package
with one class decorated with `@register`, and importing it in the package's __init__.py.
"""

from __future__ import annotations

import dataclasses

from ..._native import _C
from ..._units import format_bytes
from ..chunk_floor import chunk_floor_bytes

# [Note: safety margins]
# Device, after an iteration was measured (static and auto): chunks get the capacity less
#  (a) the non-model memory the iteration needed: the larger of torch's allocation peak and what
#      torch's allocator holds from the device at its end (its cached segments keep the
#      high-water mark, with their fragmentation);
#  (b) headroom for the next iterations to differ: 1/16 of (a), at least NON_MODEL_HEADROOM_MIN;
#  (c) the device memory neither torch nor a chunk pool holds, as measured then (the CUDA context,
#      libraries allocating outside torch; on the whole device, other processes too): a
#      gpu_memory_limit is what a card of that size holds, so it bounds the process's whole device
#      memory (allocator.outside_torch_bytes).
#  A fixed fraction of the device would keep 8.7 GiB of an H200 idle whatever the model needs.
# Host, when a policy reads it (auto): MemAvailable (per local rank) plus what enable() gives back
#  of the model's own host tensors as their values land in chunks, less HOST_RESERVE_BYTES (or
#  1/8 of the available memory where that is less) for what the process allocates later
#  (batches, Python objects, the kernel's page tables for pinned memory). The chunks enable()
#  allocates before it releases anything must also fit what is available before the release.
# The warm-up (auto on cuda under the default allocator, before anything is measured) keeps
#  WARMUP_RESERVE of the device from chunks: activations cannot be measured before they exist.
NON_MODEL_HEADROOM_MIN = 256 << 20
NON_MODEL_HEADROOM = 1 / 16  # of the measured non-model memory
HOST_RESERVE_BYTES = 4 << 30


@dataclasses.dataclass(frozen=True)
class Measurements:
    """What a policy decides from. Figures that differ between ranks arrive reduced over them."""
    device_kind: str                    # "cuda" or "sim"
    allocator_mode: str                 # "default" or "chunk" (GEMINI_EXT_ALLOCATOR)
    device_capacity_bytes: int          # gpu_memory_limit, or the device (the sim capacity on sim)
    set_shard_bytes: tuple              # per chunk set: this rank's shard of its parameter chunk, bytes
    trainable: tuple                    # per chunk set: has gradients and optimizer state
    set_bytes_per_element: int          # gradient, master and optimizer state (costs.set_bytes_per_element)
    compute_itemsize: int               # bytes per element of the parameter chunks
    sharded: bool                       # chunks are sharded over a process group
    world_size: int                     # ranks of that group
    host_available_bytes: int | None = None  # the least of any rank (policies with reads_host_memory)
    host_budget_source: str | None = None  # where that figure comes from, in words (host_memory.HostBudget)
    host_releasable_bytes: int = 0      # the model's host tensors enable() releases as it fills (least of any rank)
    frozen_master_bytes: int = 0        # the exact fp32 values of frozen parameters (layout.py): host, outside the plan
    master_itemsize: int | None = None  # a set's master, bytes per element (None: 4 beside 16-bit params)
    device_total_bytes: int = 0         # the whole device (cuda), whatever gpu_memory_limit says
    non_model_peak_bytes: int = 0       # the last iteration's, the most of any rank
    non_model_reserved_bytes: int = 0   # torch's allocator's hold on the device at its end, the most of any rank
    device_other_bytes: int = 0         # device memory neither torch nor a chunk pool holds, the most of any rank
    trace_rerecordings: int = 0         # how often the access trace changed so far
    gradients_accumulate_on_device: bool = False  # the iteration kept every gradient chunk there (no_sync)
    forward_seconds: float = 0.0        # the last iteration's forward pass (host wall time), the most of any rank
    backward_seconds: float = 0.0       # its backward pass, likewise
    optimizer_steps_during_backward: bool = False  # host CPU steps started in backward (speculation), all ranks
    cpu_optimizer_elements_per_s: float = 0.0  # the CPU optimizer kernel, measured (0: not), the least of any rank
    h2d_bytes_per_s: float = 0.0        # a host-to-device copy, measured (0: not), the least of any rank
    link_optimizer_elements_per_s: float = 0.0  # the device kernel over mapped host state (0: not), least of any rank
    # The last step's lanes (optimizer_lanes.rebalanced_link_sets): elements over kernel seconds (0: no
    # sets), the least of any rank; and the time the forward after it was blocked on them, the most.
    cpu_lane_elements_per_s_in_step: float = 0.0
    link_lane_elements_per_s_in_step: float = 0.0
    forward_optimizer_wait_seconds: float = 0.0
    host_sets_stepped_in_backward: int = 0  # that step's host sets stepped during its backward (speculation), least

    def trainable_shard_bytes(self) -> list[int]:
        return [b for b, t in zip(self.set_shard_bytes, self.trainable) if t]

    def frozen_shard_bytes(self) -> list[int]:
        return [b for b, t in zip(self.set_shard_bytes, self.trainable) if not t]


@dataclasses.dataclass(frozen=True)
class SetPlacement:
    optim_on_host: bool = False       # optimizer state (master, states) on the host: CPU steps
    param_home_on_host: bool = False  # the parameter chunk's home is the host (a device copy is a cache)
    keep_gathered: bool = False       # sharded: stays gathered after forward, until its gradients are reduced
    grad_stays_on_device: bool = False  # its state is on the device because the host cannot hold it


@dataclasses.dataclass(frozen=True)
class Placement:
    sets: tuple                     # SetPlacement per chunk set
    device_budget_bytes: int = 0    # device bytes chunks may hold; 0: the backend's capacity
    decision: dict = dataclasses.field(default_factory=dict)  # what was measured and chosen (stats())
    warnings: tuple = ()            # for the user: the engine warns with each
    params_born_on_device: bool = False  # parameter chunks allocated on the device at enable(), no host copy
    link_sets: tuple = ()           # host sets the device's kernel steps over the link (optimizer_lanes.py)

    @property
    def host_bound_sets(self) -> int:
        """Trainable sets (from the front) whose state the host cannot hold."""
        return sum(s.grad_stays_on_device for s in self.sets)

    def with_optim_on_host(self, on_host: list[bool]) -> tuple:
        return tuple(dataclasses.replace(s, optim_on_host=h) for s, h in zip(self.sets, on_host))


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """auto's plan of the host (bytes): the optimizer state of every trainable set, the part the
    host takes, the parameter copies it holds; what was available and the room planned."""
    state_bytes: int
    host_state_bytes: int
    params_host_bytes: int
    available_bytes: int | None
    planned_bytes: int | None  # what the plan may take of the host
    params_born_on_device: bool
    kept_param_bytes: int = 0  # born on the device: parameter chunks of the sets whose state is there


POLICY_CLASSES: dict = {}


def register(cls):
    """Makes a policy class selectable by its name (GeminiConfig.placement_policy)."""
    POLICY_CLASSES[cls.name] = cls
    return cls


class PlacementPolicy:
    name = ""
    reads_host_memory = False  # whether Measurements.host_available_bytes must be gathered
    reads_rates = False  # whether the CPU optimizer's and the host-to-device copy's rates must be measured

    def __init__(self, config):
        self.config = config

    def decides_after_iterations(self, device_kind: str) -> bool:
        return False

    def initial(self, m: Measurements) -> Placement:
        """The placement before the first iteration."""
        param_frac, optim_frac = self.fractions(m)
        sizes = m.trainable_shard_bytes()
        plan = _C.static_placement(sizes, param_frac, optim_frac)
        host_bound = self.host_bound(m, sizes, plan)
        sets = [SetPlacement(optim_on_host=on_host, param_home_on_host=home, keep_gathered=not reshard,
                             grad_stays_on_device=host_bound and not on_host)
                for (home, on_host), reshard in zip(plan, self._reshard(m, sizes))]
        frozen = m.frozen_shard_bytes()
        plan = _C.static_placement(frozen, self.frozen_param_frac(), 0.0)
        sets += [SetPlacement(param_home_on_host=home, keep_gathered=not reshard)
                 for (home, _), reshard in zip(plan, self._reshard(m, frozen))]
        return Placement(tuple(sets), self.warm_up_budget(m))

    def fractions(self, m: Measurements) -> tuple[float, float]:
        """(offload_param_frac, offload_optim_frac) of the initial placement."""
        return self.config.offload_param_frac, self.config.offload_optim_frac

    def frozen_param_frac(self) -> float:
        return self.config.offload_param_frac

    def host_bound(self, m: Measurements, sizes: list[int], plan) -> bool:
        """Whether the plan's device sets are there because the host cannot hold their state."""
        return False

    def warm_up_budget(self, m: Measurements) -> int:
        return 0

    def _reshard(self, m: Measurements, sizes: list[int]) -> list[bool]:
        """shard_param_frac (sharded only): which parameter chunks are re-sharded after each use,
        in exact bytes from the front of the execution order: the chunks used first in forward
        are needed last in backward, so keeping them gathered would hold their memory longest.
        The others stay gathered from forward until their gradients are reduced."""
        if not m.sharded:
            return [True] * len(sizes)
        return [home for home, _ in _C.static_placement(sizes, self.config.shard_param_frac, 0.0)]

    def after_iteration(self, m: Measurements, current: Placement) -> Placement:
        """A placement from the iteration just measured (called after the first iteration and
        whenever the access trace was re-recorded: other control flow, eval vs train)."""
        return current

    def after_step(self, m: Measurements, current: Placement) -> Placement | None:
        """A placement from the step under `current` and the forward after it, moving no data, at
        the iterations between decisions; None: no more such calls for `current`."""
        return None


def host_reserve_bytes(available: int) -> int:
    """Host memory no plan takes (the Note on safety margins)."""
    return min(HOST_RESERVE_BYTES, available // 8)


def measured_chunk_budget(m: Measurements, policy: str) -> tuple[int, list[str]]:
    # see [Note: safety margins]
    """The chunk budget from the last iteration (the Note on safety margins), never below three
    of the largest chunks (one in compute, one gradient chunk, one being fetched); with a warning
    when it had to raise it to that floor."""
    capacity = m.device_capacity_bytes
    non_model = max(m.non_model_peak_bytes, m.non_model_reserved_bytes)
    headroom = max(NON_MODEL_HEADROOM_MIN, int(non_model * NON_MODEL_HEADROOM)) if m.device_kind == "cuda" else 0
    other = m.device_other_bytes
    budget = int(capacity - non_model - headroom - other)
    floor = chunk_floor_bytes(m.set_shard_bytes)
    if budget >= floor:
        return budget, []
    return floor, [f"gemini_ext {policy} placement: the device has {format_bytes(capacity)} and an iteration needed "
                   f"{format_bytes(non_model)} of non-model memory (with {format_bytes(headroom)} of headroom and "
                   f"{format_bytes(other)} held outside torch), leaving less than three chunks "
                   f"({format_bytes(floor)}) for chunks; using {format_bytes(floor)}. Lower the batch size, use "
                   "activation checkpointing or smaller chunks."]


def warm_up_chunk_budget(capacity_bytes: int, set_shard_bytes, other_bytes: int) -> int:
    """The chunks' budget in the iteration before the first decision, where `other_bytes` of torch's
    are foreseen (the activations' warm-up, planned by gemini_ext/_engine/activations/budget.py):
    what they leave of the capacity, never below three of the largest chunk sets (one computing, one
    fetched, one reduced)."""
    return max(chunk_floor_bytes(set_shard_bytes), capacity_bytes - other_bytes)


def budget_decision(m: Measurements, budget: int, current: Placement) -> dict:
    """What a decision from measurements records (stats()["placement"]["decision"])."""
    return {"device_capacity_bytes": m.device_capacity_bytes, "non_model_peak_bytes": m.non_model_peak_bytes,
            "non_model_reserved_bytes": m.non_model_reserved_bytes, "device_other_bytes": m.device_other_bytes,
            "chunk_budget_bytes": budget, "trace_rerecordings": m.trace_rerecordings,
            "decisions": current.decision.get("decisions", 0) + 1}


def make_policy(config) -> PlacementPolicy:
    return POLICY_CLASSES[config.placement_policy](config)
