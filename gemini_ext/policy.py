"""Placement policies: each decides, the C++ GeminiManager carries it out.

[Note: the three policies]
- `static`: fixed fractions in exact bytes of chunks (core/static_placement.*):
  `offload_optim_frac` selects chunks from the *back* of the execution order (their gradients
  are complete first in backward, so CPU Adam on them has the most time), `offload_param_frac`
  from the *front* (used first in forward, needed last in backward: the longest time a host copy
  is enough). `gpu_memory_limit` (or the whole device) caps chunks *and* torch's allocations
  together: the first iteration runs with the whole limit as chunk budget; at its end, on cuda,
  the chunk budget becomes the limit minus the iteration's peak non-model memory minus a 1/16
  margin (never below three of the largest chunks), so activations are planned for as under
  `auto`. The fractions are not changed by it: what does not fit is evicted as under `const`.
  On sim, activations live on the host and the budget stays the whole capacity.
- `const`: the static fractions, with chunks capped at `const_gpu_budget` bytes on the device;
  what does not fit is evicted (farthest next use once a trace exists, LRU before).
- `auto`: the first iteration is a warm-up with every optimizer state on the host and the whole
  device as budget (on cuda under the default allocator, the device less 1/8 of it kept for the
  activations that are not measured yet: chunks never give way to torch's allocations there);
  at its end (the first optimizer step) it measures the peak non-model memory
  (activations and temporaries: the peak of torch's CUDA allocator since enable(), which also
  counts any other tensors the process holds on that GPU; nothing on sim, where activations live
  on the host), sets the chunk budget to the device minus that peak minus
  a 1/16 margin, keeps the parameter chunks on the device (evicting under the budget when they do
  not all fit), and then moves the optimizer state of as many chunk sets as fit, from the front
  of the execution order, to the device so that fused GPU Adam takes that part of the step. It
  reports what it chose in `engine.stats()["placement"]`. When the access trace changes (it is
  re-recorded), it measures the next iteration's non-model peak again and re-places, moving
  optimizer state back to the host if it no longer fits.
  Host memory bounds it too: when the host cannot hold every optimizer state (MemAvailable less a
  1/8 margin, shared by the ranks of the node), the warm-up already keeps the state of the front
  chunk sets on the device (allocated there directly, never on the host) so that the rest fits,
  and later decisions never move those back, nor evict those sets' gradients to the host (it
  has no room for them: parameter chunks make room instead). A model whose parameters,
  gradients and optimizer state exceed the host (13B: 16 bytes per parameter, 208 GB) trains
  this way, split between host and device. When that state, its gradients and three gathered chunks do not fit the
  warm-up's budget either, the model fits neither, and enable() raises OutOfMemoryError with
  the figures while planning, before any memory is taken.
"""

from __future__ import annotations

import os
import time
import warnings

import torch

from . import _C, allocator
from ._env import logger
from ._units import format_bytes

POLICIES = ("static", "auto", "const")


class PlacementPolicy:
    name = "static"

    def __init__(self, config):
        self.config = config
        self.decision: dict = {}
        self.min_device_sets = 0  # trainable sets (from the front) whose state the host cannot hold

    def fractions(self) -> tuple[float, float]:
        """(offload_param_frac, offload_optim_frac) of the initial placement."""
        return self.config.offload_param_frac, self.config.offload_optim_frac

    def initial_fractions(self, engine, param_chunk_bytes: list[int]) -> tuple[float, float]:
        """The initial placement's fractions, given the 16-bit bytes of each trainable parameter
        chunk (this rank's shards) in execution order."""
        return self.fractions()

    def device_budget(self, engine) -> int:
        return 0  # the backend's capacity

    def after_iteration(self, engine) -> None:
        """Decides again after the first iteration and whenever the access trace was re-recorded
        (other control flow, sequence length, eval vs train), from the iteration just measured."""
        if not self.plans_from_measurements(engine):
            return
        rerecordings = engine._gm.trace_info()["rerecordings"]
        if self.decision and rerecordings == self.decision["trace_rerecordings"]:
            return
        self._decide(engine, rerecordings)

    def plans_from_measurements(self, engine) -> bool:
        return False

    def _decide(self, engine, rerecordings: int) -> None:
        raise NotImplementedError


def device_capacity_bytes(engine) -> int:
    """The device bytes the engine plans for: `gpu_memory_limit` (or GEMINI_EXT_GPU_LIMIT), never
    more than the device has; the sim device's capacity on sim."""
    capacity = engine._ctx.capacity_bytes
    if engine.device_kind == "cuda":
        total = torch.cuda.mem_get_info(engine.compute_device)[1]
        capacity = min(capacity, total) if capacity else total
    return int(capacity)


def measured_chunk_budget(engine, margin: float) -> tuple[int, int, int]:
    """(device capacity, peak non-model bytes of the last iteration, chunk budget): the capacity
    (`gpu_memory_limit`, or the device) minus what torch's allocator peaked at minus a margin,
    never below three of the largest chunks (one in compute, one gradient chunk, one being
    fetched); it warns when it had to raise the budget to that floor."""
    capacity = device_capacity_bytes(engine)
    non_model = engine._steps_log[-1]["non_model_peak_bytes"] if engine._steps_log else 0
    if engine._dp_group is not None:
        # Every rank takes the same decision: from the largest measurement of any rank.
        t = torch.tensor([float(non_model)], dtype=torch.float64, device=engine.compute_device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=engine._dp_group)
        non_model = int(t.item())
    budget = int(capacity - non_model - capacity * margin)
    floor = 3 * largest_chunk_bytes(engine)
    if budget < floor:
        warnings.warn(f"gemini_ext {engine.policy.name} placement: the device has {format_bytes(capacity)} and an "
                      f"iteration peaked at {format_bytes(non_model)} of non-model memory, leaving less than three "
                      f"chunks ({format_bytes(floor)}) for chunks; using {format_bytes(floor)}. Lower the batch size, "
                      "use activation checkpointing or smaller chunks.", stacklevel=3)
        budget = floor
    return int(capacity), int(non_model), budget


HOST_MARGIN = 1 / 8


def _proc_field_bytes(path: str, key: str) -> int | None:
    """A "Key:  N kB" line of a /proc file (Linux) in bytes; None where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def mem_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where it cannot be read."""
    return _proc_field_bytes("/proc/meminfo", "MemAvailable:")


def process_rss_bytes() -> int | None:
    """VmRSS of /proc/self/status in bytes: this process's resident memory, chunks and everything
    else; None where it cannot be read."""
    return _proc_field_bytes("/proc/self/status", "VmRSS:")


def host_available_bytes() -> int | None:
    """Host memory this process may still fill: MemAvailable over the ranks of this node
    (LOCAL_WORLD_SIZE); None where it cannot be read."""
    available = mem_available_bytes()
    if available is None:
        return None
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def host_optimizer_bytes_per_element(engine) -> int:
    """Host bytes per element of a chunk set whose optimizer state lives on the host: its 16-bit
    gradient, the fp32 master (16-bit precisions only), exp_avg and exp_avg_sq."""
    item = engine.compute_dtype.itemsize
    return item + (4 if engine.compute_dtype != torch.float32 else 0) + 8


def largest_chunk_bytes(engine) -> int:
    mgr = engine._mgr
    item = engine.compute_dtype.itemsize
    return max(mgr.chunk_info(p["param_chunk"])["shard_numel"] for p in engine._gm.set_placements()) * item


class StaticPolicy(PlacementPolicy):
    name = "static"
    MARGIN = 1 / 16

    def plans_from_measurements(self, engine) -> bool:
        return engine.device_kind == "cuda"  # on sim, activations live on the host

    def _decide(self, engine, rerecordings: int) -> None:
        # Plan for the activations just measured: the fractions stay, what does not fit is evicted.
        capacity, non_model, budget = measured_chunk_budget(engine, self.MARGIN)
        engine._gm.set_device_budget(budget)
        self.decision = {"device_capacity_bytes": capacity, "non_model_peak_bytes": non_model,
                         "chunk_budget_bytes": budget, "trace_rerecordings": rerecordings,
                         "decisions": self.decision.get("decisions", 0) + 1}


class ConstPolicy(PlacementPolicy):
    name = "const"

    def __init__(self, config):
        super().__init__(config)
        if config.const_gpu_budget is None:
            raise ValueError("placement_policy='const' needs const_gpu_budget (bytes or a string such as '8GiB'): "
                             "the constant device budget for chunks.")

    def device_budget(self, engine) -> int:
        return int(self.config.const_gpu_budget)


class AutoPolicy(PlacementPolicy):
    name = "auto"
    MARGIN = 1 / 16
    WARMUP_RESERVE = 1 / 8  # of the device, kept from chunks for the warm-up's unmeasured activations

    def fractions(self):
        return 0.0, 1.0  # warm-up: parameters on the device, every optimizer state on the host

    def initial_fractions(self, engine, param_chunk_bytes):
        # Every optimizer state on the host for the warm-up, unless the host cannot hold it: then
        # the back of the execution order stays on the host (what fits) and the front goes to
        # the device from the start.
        item = engine.compute_dtype.itemsize
        params_host = sum(param_chunk_bytes)  # the parameter chunks' host copies
        per_element = host_optimizer_bytes_per_element(engine)
        optim_host = sum(b // item for b in param_chunk_bytes) * per_element
        available = host_available_bytes()
        if available is not None and engine._dp_group is not None:
            t = torch.tensor([float(available)], dtype=torch.float64,
                             device=engine.compute_device if engine.device_kind == "cuda" else "cpu")
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=engine._dp_group)
            available = int(t.item())  # every rank takes the same decision
        if available is None or params_host + optim_host <= available * (1 - HOST_MARGIN):
            return 0.0, 1.0
        allowed = max(0.0, available * (1 - HOST_MARGIN) - params_host)
        optim_frac = allowed / optim_host
        plan = _C.static_placement(list(param_chunk_bytes), 0.0, optim_frac)
        self.min_device_sets = sum(1 for _, on_host in plan if not on_host)
        logger.info("auto placement: the host has %s available for %s of parameter copies and %s of optimizer state; "
                    "the optimizer state of the first %d of %d chunk sets starts on the device",
                    format_bytes(available), format_bytes(params_host), format_bytes(optim_host),
                    self.min_device_sets, len(param_chunk_bytes))
        forced_elements = sum(b // item for b, (_, on_host) in zip(param_chunk_bytes, plan) if not on_host)
        self._check_device_holds_forced_state(engine, param_chunk_bytes, forced_elements, available, params_host,
                                              optim_host)
        return 0.0, optim_frac

    def _check_device_holds_forced_state(self, engine, param_chunk_bytes, forced_elements: int, available: int,
                                         params_host: int, optim_host: int) -> None:
        """Before any memory is taken: the optimizer state the host cannot hold, with its
        gradients and three gathered chunks in flight, must fit the warm-up's device budget and
        the margin of every later decision (nothing evicts that state or its gradients; only
        parameter chunks make room). Otherwise the model does not fit this rank's host and
        device together, and the first iteration would run out of memory after the whole set-up."""
        item = engine.compute_dtype.itemsize
        master = 4 if engine.compute_dtype != torch.float32 else 0
        forced = forced_elements * (master + 8 + item)  # master, exp_avg, exp_avg_sq, gradient
        in_flight = 3 * max(param_chunk_bytes) * engine.world_size  # gathered: every rank's shard
        capacity = device_capacity_bytes(engine)
        warm_up = self.device_budget(engine)  # 0: the whole device
        later = int(capacity * (1 - self.MARGIN))  # the most a later decision can give
        budget = min(warm_up or capacity, later)
        if forced + in_flight <= budget:
            return
        reserve = f" ({format_bytes(capacity)} less {format_bytes(capacity - budget)} kept free for activations)"
        fixes = "use more data-parallel ranks (each holds 1/N of the state), free host memory, or train a smaller model"
        if warm_up and forced + in_flight <= later:
            fixes = ("set GEMINI_EXT_ALLOCATOR=chunk (before importing gemini_ext: chunks then give way to "
                     "activations on demand, and the first iteration may use the whole device), " + fixes)
        raise _C.OutOfMemoryError(
            f"gemini_ext auto placement: the model does not fit this rank's host and device memory. The host has "
            f"{format_bytes(available)} available (planned to {1 - HOST_MARGIN:.3g} of it) for "
            f"{format_bytes(params_host)} of parameter copies and {format_bytes(optim_host)} of optimizer state, so "
            f"the optimizer state of {forced_elements:,} elements must live on the device: {format_bytes(forced)} "
            f"with their gradients, plus {format_bytes(in_flight)} for three parameter chunks in flight, against a "
            f"device budget of {format_bytes(budget)}{reserve}. To train it, {fixes}.")

    def device_budget(self, engine) -> int:
        # The warm-up's chunk budget. Activations are not measured yet: on cuda under the default
        # allocator (chunks never give way to torch's allocations) WARMUP_RESERVE of the device is
        # kept for them, else chunks could fill the device (optimizer state the host cannot hold,
        # say) and the first forward run out of memory. On sim activations live on the host, and
        # under GEMINI_EXT_ALLOCATOR=chunk an allocation evicts chunks: the whole device (0).
        if engine.device_kind != "cuda" or allocator.mode() == "chunk":
            return 0
        return int(device_capacity_bytes(engine) * (1 - self.WARMUP_RESERVE))

    def plans_from_measurements(self, engine) -> bool:
        return True

    def _decide(self, engine, rerecordings: int) -> None:
        gm, mgr = engine._gm, engine._mgr
        capacity, non_model, budget = measured_chunk_budget(engine, self.MARGIN)
        placements = gm.set_placements()
        shard = {p["param_chunk"]: mgr.chunk_info(p["param_chunk"])["shard_numel"] for p in placements}
        item = engine.compute_dtype.itemsize
        p_bytes = sum(shard[p["param_chunk"]] * item for p in placements)
        largest = max(shard.values()) * item
        remaining = budget - p_bytes - 2 * largest  # parameters first, with room for two chunks in flight
        master = 4 if engine.compute_dtype != torch.float32 else 0
        on_device = set()
        trainable_seen = 0
        for index, p in enumerate(placements):  # from the front of the execution order
            if not p["trainable"]:
                continue
            cost = shard[p["param_chunk"]] * (master + 4 + 4 + item)  # master, m, v, gradient
            host_bound = trainable_seen < self.min_device_sets  # the host cannot hold it
            trainable_seen += 1
            if cost > remaining and not host_bound:
                break
            remaining -= cost
            on_device.add(index)
        if remaining < 0:
            if self.min_device_sets:
                why = (f"the host cannot hold the optimizer state of the first {self.min_device_sets} chunk sets and the "
                       f"device budget ({format_bytes(budget)}) cannot hold it beside the parameters either "
                       f"({format_bytes(-remaining)} short)")
                fix = "More data-parallel ranks or more host memory would keep every parameter chunk on the device."
            else:
                why = (f"the parameter chunks ({format_bytes(p_bytes)}) and two chunks in flight do not fit the device "
                       f"budget ({format_bytes(budget)})")
                fix = "Lower the batch size or use activation checkpointing."
            warnings.warn(f"gemini_ext auto placement: {why}; parameter chunks will be evicted and fetched as needed. {fix}",
                          stacklevel=3)
        # Shrink first (states going to the host free device bytes), then grow.
        moves_started = time.perf_counter()
        for index, p in enumerate(placements):
            if p["trainable"] and not p["optim_on_host"] and index not in on_device:
                gm.set_optim_on_host(index, True)
        gm.set_device_budget(budget)
        for index in sorted(on_device):
            if placements[index]["optim_on_host"]:
                gm.set_optim_on_host(index, False)
        self.decision = {"device_capacity_bytes": capacity, "non_model_peak_bytes": non_model,
                         "chunk_budget_bytes": budget, "param_chunk_bytes": p_bytes,
                         "optim_sets_moved_to_device": len(on_device), "params_fit": p_bytes + 2 * largest <= budget,
                         "optim_sets_kept_on_device_for_host": self.min_device_sets,
                         "trace_rerecordings": rerecordings,
                         "move_seconds": time.perf_counter() - moves_started,  # the state moved to its tiers
                         "decisions": self.decision.get("decisions", 0) + 1}
        logger.info("auto placement (decision %d): capacity %s, non-model peak %s, chunk budget %s, parameter chunks "
                    "%s, optimizer state of %d chunk sets on the device (moves took %.1f s)", self.decision["decisions"],
                    format_bytes(capacity), format_bytes(non_model), format_bytes(budget), format_bytes(p_bytes),
                    len(on_device), self.decision["move_seconds"])


def make_policy(config) -> PlacementPolicy:
    return {"static": StaticPolicy, "const": ConstPolicy, "auto": AutoPolicy}[config.placement_policy](config)
