"""The `auto` placement: measured, then re-placed.

The first iteration is a warm-up with every optimizer state on the host and the whole device as
budget (on cuda under the default allocator, the device less WARMUP_RESERVE of it kept for the
activations that are not measured yet: chunks never give way to torch's allocations there); at its
end (the first optimizer step) it sets the chunk budget from what the iteration needed besides
chunks (the Note on safety margins in base.py), keeps the parameter chunks on the device (evicting
under the budget when they do not all fit), and then moves the optimizer state of as many chunk sets
as fit, from the front of the execution order, to the device so that fused GPU Adam takes that part
of the step (under accumulation, every gradient chunk stays on the device until the step: those are
reserved first). Where the CPU step of the rest would outlast the backward pass, it weighs moving
further sets' state there, evicting parameter chunks to make room, with measured rates
(gemini_ext/placement/optimizer_split.py): on a fast host the fetches cost more than the CPU time
saved and it stays at what fits. Where the CPU step of the host's state would still be waited for,
it gives some host sets to the link lane, the device's kernel stepping their host state over the
link beside the CPU (gemini_ext/placement/optimizer_lanes.py). It reports what it chose in
`engine.stats()["placement"]`. When the access trace changes (it is re-recorded), it measures the
next iteration again and re-places, moving optimizer state back to the host if it no longer fits.
Host memory bounds it too (planned as the Note on safety margins in base.py says): when the host
cannot hold every optimizer state, the warm-up already keeps the state of the front chunk sets on
the device (allocated there directly, never on the host) so that the rest fits, and later decisions
never move those back, nor evict those sets' gradients to the host (it has no room for them: other
parameter chunks make room instead). Where every such set's parameter chunk fits beside that state,
those parameter chunks are born on the device too and stay there, and the host plan holds parameter
copies only of the sets it steps. A model whose parameters, gradients and optimizer state exceed the
host (15B: 16 bytes per parameter, 247 GB) trains this way, split between host and device. When that
state, its gradients (and parameter chunks) and three chunks in flight do not fit the warm-up's
budget either, the model fits neither, and enable() raises OutOfMemoryError with the figures while
planning, before any memory is taken.
"""

from __future__ import annotations

import dataclasses

from ..._native import _C
from ..._units import format_bytes
from ..chunk_floor import chunk_floor_bytes
from ..optimizer_lanes import REBALANCES, link_lane_sets, rebalanced_link_sets
from ..optimizer_split import beyond_fit_by_rates
from .base import (NON_MODEL_HEADROOM_MIN, HostPlan, Measurements, Placement, PlacementPolicy, budget_decision,
                   host_reserve_bytes, measured_chunk_budget, register)


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
        free_after_bytes = after - host_reserve_bytes(after) - m.frozen_master_bytes
        free_during_bytes = m.host_available_bytes - host_reserve_bytes(after) - m.frozen_master_bytes
        # What enable() allocates on the host before it releases the model's tensors: a host
        # set's gradient and fp32 master (its moments come with the optimizer), parameter copies.
        master = m.master_itemsize if m.master_itemsize is not None else (4 if m.compute_itemsize != 4 else 0)
        first = m.compute_itemsize + master  # costs.set_bytes_per_element's parts
        budget = self.warm_up_budget(m) or m.device_capacity_bytes
        in_flight = chunk_floor_bytes(m.set_shard_bytes) * m.world_size
        for born_on_device in (True, False):
            if born_on_device:  # per host element: its state and its parameter copy
                limit = min(free_after_bytes // (m.set_bytes_per_element + m.compute_itemsize),
                            free_during_bytes // (first + m.compute_itemsize))
            else:  # every parameter chunk has a host copy
                limit = min((free_after_bytes - param_bytes) // m.set_bytes_per_element,
                            (free_during_bytes - param_bytes) // first)
            host_elements = self._elements_from_back(elements, max(0, limit))
            forced_elements = sum(elements) - host_elements
            born = born_on_device and forced_elements > 0
            params_host = host_elements * m.compute_itemsize if born else param_bytes
            plan = HostPlan(state_bytes, host_elements * m.set_bytes_per_element, params_host,
                            m.host_available_bytes, free_after_bytes, born,
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
        in_flight = chunk_floor_bytes(param_chunk_bytes) * m.world_size  # gathered: every rank's shard
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
            f"{f' ({m.host_budget_source})' if m.host_budget_source else ''}{released}, planned to "
            f"{format_bytes(host.planned_bytes)} "
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
                if p_bytes + grads_kept + 2 * largest > m.device_capacity_bytes - m.device_other_bytes:
                    fix = (f"They are more than the whole device budget ({format_bytes(m.device_capacity_bytes)}) "
                           "even without activations, so a smaller batch would not keep them: raise "
                           "gpu_memory_limit, or shard them over more data-parallel ranks.")
                else:
                    fix = ("The activations take the rest: lower the batch size or sequence length, or let the engine "
                           "plan them (GeminiConfig(activation_checkpointing='auto', activation_offload='auto')).")
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
        decision = {**current.decision, "lane_rebalances": done + 1,
                    **{f"rebalance_{k}": v for k, v in figures.items()}}
        return dataclasses.replace(current, decision=decision, link_sets=link_sets, warnings=())
