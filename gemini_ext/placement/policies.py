"""Placement policies: pure functions of measurements that return a placement.

A policy is called twice over: `initial(m)` before any memory is taken (the chunk layout is
known), and `after_iteration(m, current)` at each iteration's end when `decides_after_iterations`
holds. Each returns a `Placement`: per chunk set, where its optimizer state lives, its parameter
chunk's home, whether it stays gathered, whether its gradient stays on the device; and the
device budget for chunks. The engine (gemini_ext/placement/placer.py) gathers the `Measurements`
(doing the collectives, so every rank decides alike), calls the policy, and applies the
difference through the C++ GeminiManager. A policy moves nothing and keeps no state of its own:
what it needs from the past comes in `current`. Adding a policy means adding one class here and
decorating it with `@register`.

[Note: the three policies]
- `static`: fixed fractions in exact bytes of chunks (core/static_placement.*):
  `offload_optim_frac` selects chunks from the *back* of the execution order (their gradients
  are complete first in backward, so CPU Adam on them has the most time), `offload_param_frac`
  from the *front* (used first in forward, needed last in backward: the longest time a host copy
  is enough). `gpu_memory_limit` (or the whole device) caps chunks *and* torch's allocations
  together: the first iteration runs with the whole limit as chunk budget; at its end, on cuda,
  the chunk budget becomes the limit less what the iteration needed besides chunks (the Note on
  safety margins below; never below three of the largest chunks), so activations are planned
  for as under `auto`. The fractions are not changed by it: what does not fit is evicted as
  under `const`. On sim, activations live on the host and the budget stays the whole capacity.
- `const`: the static fractions, with chunks capped at `const_gpu_budget` bytes on the device;
  what does not fit is evicted (farthest next use once a trace exists, LRU before).
- `auto`: the first iteration is a warm-up with every optimizer state on the host and the whole
  device as budget (on cuda under the default allocator, the device less WARMUP_RESERVE of it
  kept for the activations that are not measured yet: chunks never give way to torch's
  allocations there); at its end (the first optimizer step) it sets the chunk budget from what
  the iteration needed besides chunks (the Note on safety margins), keeps the parameter chunks
  on the device (evicting under the budget when they do not all fit), and then moves the
  optimizer state of as many chunk sets as fit, from the front of the execution order, to the
  device so that fused GPU Adam takes that part of the step (under accumulation, every
  gradient chunk stays on the device until the step: those are reserved first). Where the CPU
  step of the rest would outlast the backward pass, it weighs moving further sets' state there,
  evicting parameter chunks to make room, with measured rates (gemini_ext/placement/optimizer_split.py):
  on a fast host the fetches cost more than the CPU time saved and it stays at what fits. Where
  the CPU step of the host's state would still be waited for, it gives some host sets to the
  link lane, the device's kernel stepping their host state over the link beside the CPU
  (gemini_ext/placement/optimizer_lanes.py). It reports
  what it chose in
  `engine.stats()["placement"]`. When the access trace changes (it is re-recorded), it measures
  the next iteration again and re-places, moving optimizer state back to the host if it no
  longer fits.
  Host memory bounds it too (planned as the Note on safety margins says): when the host cannot
  hold every optimizer state, the warm-up already keeps the state of the front chunk sets on the
  device (allocated there directly, never on the host) so that the rest fits, and later
  decisions never move those back, nor evict those sets' gradients to the host (it has no room
  for them: other parameter chunks make room instead). Where every such set's parameter chunk
  fits beside that state, those parameter chunks are born on the device too and stay there,
  and the host plan holds parameter copies only of the sets it steps. A model whose
  parameters, gradients and optimizer state exceed the host (15B: 16 bytes per parameter,
  247 GB) trains this way, split between host and device. When that state, its gradients (and
  parameter chunks) and three chunks in flight do not fit the warm-up's budget either, the model
  fits neither, and enable() raises OutOfMemoryError with the figures while planning, before any
  memory is taken.
"""

from __future__ import annotations

import dataclasses

from .. import _C
from .optimizer_lanes import REBALANCES, link_lane_sets, rebalanced_link_sets
from .optimizer_split import beyond_fit_by_rates
from .._units import format_bytes

# [Note: safety margins]
# Device, after an iteration was measured (static and auto): chunks get the capacity less
#  (a) the non-model memory the iteration needed: the larger of torch's allocation peak and what
#      torch's allocator holds from the device at its end (its cached segments keep the
#      high-water mark, with their fragmentation);
#  (b) headroom for the next iterations to differ: 1/16 of (a), at least NON_MODEL_HEADROOM_MIN;
#  (c) on the whole device (no gpu_memory_limit), the device memory neither torch nor a chunk
#      pool holds, as measured then (the CUDA context, libraries allocating outside torch).
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
    room_bytes: int | None
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
    """The chunk budget from the last iteration (the Note on safety margins), never below three
    of the largest chunks (one in compute, one gradient chunk, one being fetched); with a warning
    when it had to raise it to that floor."""
    capacity = m.device_capacity_bytes
    non_model = max(m.non_model_peak_bytes, m.non_model_reserved_bytes)
    headroom = max(NON_MODEL_HEADROOM_MIN, int(non_model * NON_MODEL_HEADROOM)) if m.device_kind == "cuda" else 0
    other = m.device_other_bytes if capacity >= m.device_total_bytes else 0  # a gpu_memory_limit excludes it
    budget = int(capacity - non_model - headroom - other)
    floor = 3 * max(m.set_shard_bytes)
    if budget >= floor:
        return budget, []
    return floor, [f"gemini_ext {policy} placement: the device has {format_bytes(capacity)} and an iteration needed "
                   f"{format_bytes(non_model)} of non-model memory (with {format_bytes(headroom)} of headroom and "
                   f"{format_bytes(other)} held outside torch), leaving less than three chunks "
                   f"({format_bytes(floor)}) for chunks; using {format_bytes(floor)}. Lower the batch size, use "
                   "activation checkpointing or smaller chunks."]


def budget_decision(m: Measurements, budget: int, current: Placement) -> dict:
    """What a decision from measurements records (stats()["placement"]["decision"])."""
    return {"device_capacity_bytes": m.device_capacity_bytes, "non_model_peak_bytes": m.non_model_peak_bytes,
            "non_model_reserved_bytes": m.non_model_reserved_bytes, "device_other_bytes": m.device_other_bytes,
            "chunk_budget_bytes": budget, "trace_rerecordings": m.trace_rerecordings,
            "decisions": current.decision.get("decisions", 0) + 1}


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
class AutoPolicy(PlacementPolicy):
    name = "auto"
    reads_host_memory = True
    reads_rates = True
    WARMUP_RESERVE = 1 / 8  # of the device, kept from chunks for the warm-up's unmeasured activations

    def decides_after_iterations(self, device_kind: str) -> bool:
        return True

    def frozen_param_frac(self) -> float:
        return 0.0

    def initial(self, m: Measurements) -> Placement:
        plan = self._host_plan(m)
        placement = super().initial(m)
        return dataclasses.replace(placement, params_born_on_device=plan.params_born_on_device)

    def _host_plan(self, m: Measurements) -> "HostPlan":
        """How much optimizer state the host takes (whole chunk sets from the back of the
        execution order), and whether the parameter chunks of the sets whose state is on the
        device are allocated there directly. A set stepped on the host needs its parameter chunk's
        host copy (the CPU step writes it); one stepped on the device does not, as long as it is
        never evicted (Residency keeps it, as it keeps those sets' gradient chunks): so when those
        sets' parameter chunks fit the warm-up's device budget beside their state, they are born
        on the device and count with that state; else every parameter chunk has a host copy."""
        sizes = m.trainable_shard_bytes()
        elements = [b // m.compute_itemsize for b in sizes]
        state_bytes = sum(elements) * m.set_bytes_per_element
        param_bytes = sum(m.set_shard_bytes)
        if m.host_available_bytes is None:
            return HostPlan(state_bytes, state_bytes, param_bytes, None, None, False)
        after = m.host_available_bytes + m.host_releasable_bytes
        room_after = after - host_reserve_bytes(after)
        room_during = m.host_available_bytes - host_reserve_bytes(after)
        # What enable() allocates on the host before it releases the model's tensors: a host
        # set's gradient and fp32 master (its moments come with the optimizer), parameter copies.
        master = m.master_itemsize if m.master_itemsize is not None else (4 if m.compute_itemsize != 4 else 0)
        first = m.compute_itemsize + master  # costs.set_bytes_per_element's parts
        budget = self.warm_up_budget(m) or m.device_capacity_bytes
        in_flight = 3 * max(m.set_shard_bytes) * m.world_size
        for born_on_device in (True, False):
            if born_on_device:  # per host element: its state and its parameter copy
                limit = min(room_after // (m.set_bytes_per_element + m.compute_itemsize),
                            room_during // (first + m.compute_itemsize))
            else:  # every parameter chunk has a host copy
                limit = min((room_after - param_bytes) // m.set_bytes_per_element,
                            (room_during - param_bytes) // first)
            host_elements = self._elements_from_back(elements, max(0, limit))
            forced_elements = sum(elements) - host_elements
            born = born_on_device and forced_elements > 0
            params_host = host_elements * m.compute_itemsize if born else param_bytes
            plan = HostPlan(state_bytes, host_elements * m.set_bytes_per_element, params_host,
                            m.host_available_bytes, room_after, born,
                            forced_elements * m.compute_itemsize if born else 0)
            device_bytes = plan.kept_param_bytes + forced_elements * m.set_bytes_per_element + in_flight
            if not born_on_device or device_bytes <= budget:
                return plan
        raise AssertionError("unreachable")

    @staticmethod
    def _elements_from_back(elements: list[int], limit: int) -> int:
        """The elements of the chunk sets the host takes: whole sets from the back, within `limit`."""
        taken = 0
        for n in reversed(elements):
            if taken + n > limit:
                break
            taken += n
        return taken

    def fractions(self, m: Measurements) -> tuple[float, float]:
        # Every optimizer state on the host for the warm-up, unless the host cannot hold it: then
        # the back of the execution order stays on the host (what fits) and the front goes to
        # the device from the start.
        plan = self._host_plan(m)
        return 0.0, (plan.host_state_bytes / plan.state_bytes if plan.state_bytes else 1.0)

    def host_bound(self, m: Measurements, sizes: list[int], plan) -> bool:
        host = self._host_plan(m)
        if host.host_state_bytes >= host.state_bytes:
            return False
        forced_elements = sum(b // m.compute_itemsize for b, (_, on_host) in zip(sizes, plan) if not on_host)
        if host.params_born_on_device:  # those sets' parameter chunks, as the placement chose them
            kept = sum(b for b, (_, on_host) in zip(sizes, plan) if not on_host)
            host = dataclasses.replace(host, kept_param_bytes=kept)
        self._check_device_holds_forced_state(m, sizes, forced_elements, host)
        return any(not on_host for _, on_host in plan)

    def _check_device_holds_forced_state(self, m: Measurements, param_chunk_bytes, forced_elements: int,
                                         host: "HostPlan") -> None:
        """Before any memory is taken: the optimizer state the host cannot hold, with its
        gradients and three gathered chunks in flight, must fit the warm-up's device budget and
        what a later decision can give (nothing evicts that state or its gradients; only
        parameter chunks make room). Otherwise the model does not fit this rank's host and
        device together, and the first iteration would run out of memory after the whole set-up."""
        forced = forced_elements * m.set_bytes_per_element + host.kept_param_bytes  # master, states, gradient (P)
        in_flight = 3 * max(param_chunk_bytes) * m.world_size  # gathered: every rank's shard
        capacity = m.device_capacity_bytes
        warm_up = self.warm_up_budget(m)  # 0: the whole device
        later = capacity - NON_MODEL_HEADROOM_MIN if m.device_kind == "cuda" else capacity
        budget = min(warm_up or capacity, later)
        if forced + in_flight <= budget:
            return
        reserve = f" ({format_bytes(capacity)} less {format_bytes(capacity - budget)} kept free for activations)"
        fixes = "use more data-parallel ranks (each holds 1/N of the state), free host memory, or train a smaller model"
        if warm_up and forced + in_flight <= later:
            fixes = ("set GEMINI_EXT_ALLOCATOR=chunk (before importing gemini_ext: chunks then give way to "
                     "activations on demand, and the first iteration may use the whole device), " + fixes)
        released = (f" and {format_bytes(m.host_releasable_bytes)} the model's own host tensors give back"
                    if m.host_releasable_bytes else "")
        raise _C.OutOfMemoryError(
            f"gemini_ext auto placement: the model does not fit this rank's host and device memory. The host has "
            f"{format_bytes(host.available_bytes)} available"
            f"{f' ({m.host_budget_source})' if m.host_budget_source else ''}{released}, planned to {format_bytes(host.room_bytes)} "
            f"(less {format_bytes(host_reserve_bytes(host.available_bytes + m.host_releasable_bytes))} kept for the "
            f"process), for {format_bytes(host.params_host_bytes)} of parameter copies and "
            f"{format_bytes(host.state_bytes)} of optimizer state, so the optimizer state of {forced_elements:,} "
            f"elements must live on the device: {format_bytes(forced)} with their gradients"
            f"{' and parameter chunks' if host.kept_param_bytes else ''}, plus "
            f"{format_bytes(in_flight)} for three parameter chunks in flight, against a device budget of "
            f"{format_bytes(budget)}{reserve}. To train it, {fixes}.")

    def warm_up_budget(self, m: Measurements) -> int:
        # Activations are not measured yet: on cuda under the default allocator (chunks never
        # give way to torch's allocations) WARMUP_RESERVE of the device is kept for them, else
        # chunks could fill the device (optimizer state the host cannot hold, say) and the first
        # forward run out of memory. On sim activations live on the host, and under
        # GEMINI_EXT_ALLOCATOR=chunk an allocation evicts chunks: the whole device (0).
        if m.device_kind != "cuda" or m.allocator_mode == "chunk":
            return 0
        return int(m.device_capacity_bytes * (1 - self.WARMUP_RESERVE))

    def after_iteration(self, m: Measurements, current: Placement) -> Placement:
        # The parameter chunks stay on the device (evicted under the budget when they do not all
        # fit); then the optimizer state of as many sets as fit, from the front, moves there.
        budget, warnings = measured_chunk_budget(m, self.name)
        p_bytes = sum(m.set_shard_bytes)
        largest = max(m.set_shard_bytes)
        # Parameters first, with room for two chunks in flight; under accumulation (no_sync) every
        # gradient chunk stays on the device until the step, wherever its optimizer state lives.
        grads_kept = sum(m.trainable_shard_bytes()) if m.gradients_accumulate_on_device else 0
        remaining = budget - p_bytes - 2 * largest - grads_kept
        state_per_element = m.set_bytes_per_element - (m.compute_itemsize if grads_kept else 0)
        host_bound_sets = current.host_bound_sets
        on_device = set()
        trainable_seen = 0
        for index, (shard, trainable) in enumerate(zip(m.set_shard_bytes, m.trainable)):
            if not trainable:
                continue
            cost = shard // m.compute_itemsize * state_per_element
            host_bound = trainable_seen < host_bound_sets  # the host cannot hold it
            trainable_seen += 1
            if cost > remaining and not host_bound:
                break
            remaining -= cost
            on_device.add(index)
        if remaining < 0:
            if host_bound_sets:
                why = (f"the host cannot hold the optimizer state of the first {host_bound_sets} chunk sets and the "
                       f"device budget ({format_bytes(budget)}) cannot hold it beside the parameters either "
                       f"({format_bytes(-remaining)} short)")
                fix = "More data-parallel ranks or more host memory would keep every parameter chunk on the device."
            else:
                kept = (f", the gradient chunks accumulation keeps ({format_bytes(grads_kept)})," if grads_kept
                        else "")
                why = (f"the parameter chunks ({format_bytes(p_bytes)}){kept} and two chunks in flight do not fit the "
                       f"device budget ({format_bytes(budget)})")
                fix = "Lower the batch size or use activation checkpointing."
            warnings.append(f"gemini_ext auto placement: {why}; parameter chunks will be evicted and fetched as "
                            f"needed. {fix}")
        rates = {}
        if remaining >= 0 and not host_bound_sets:  # every parameter chunk fits: weigh moving more state
            extra, rates = beyond_fit_by_rates(m, on_device, remaining, state_per_element)
            on_device |= extra
        on_host = [t and index not in on_device for index, t in enumerate(m.trainable)]
        link_sets, lanes = link_lane_sets(m, on_host)
        decision = {**budget_decision(m, budget, current), "param_chunk_bytes": p_bytes,
                    "grad_bytes_kept_for_accumulation": grads_kept,
                    "optim_sets_moved_to_device": len(on_device), "params_fit": p_bytes + 2 * largest <= budget,
                    "optim_sets_kept_on_device_for_host": host_bound_sets, **rates, **lanes,
                    "move_seconds": 0.0}  # the engine times the moves it makes
        return Placement(current.with_optim_on_host(on_host), budget, decision, tuple(warnings), link_sets=link_sets)

    def after_step(self, m: Measurements, current: Placement) -> Placement | None:
        # Which lane steps each host set, from the step just measured (optimizer_lanes.py).
        done = current.decision.get("lane_rebalances", 0)
        if "link_optimizer_elements_per_s" not in current.decision or done >= REBALANCES:
            return None  # no link lane was weighed (no rate, speculation), or checked enough
        on_host = [s.optim_on_host and t for s, t in zip(current.sets, m.trainable)]
        link_sets, figures = rebalanced_link_sets(m, on_host, current.link_sets)
        decision = {**current.decision, "lane_rebalances": done + 1, **{f"rebalance_{k}": v for k, v in figures.items()}}
        return dataclasses.replace(current, decision=decision, link_sets=link_sets, warnings=())


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



def make_policy(config) -> PlacementPolicy:
    return POLICY_CLASSES[config.placement_policy](config)
