"""Carrying a placement policy's decisions out: the engine's side of gemini_ext/placement/policies/.

`Placer` gathers the measurements a policy decides from (host memory, the last iteration's
non-model peak from the MemoryTracer, the access trace's re-recordings), reducing the figures
that differ between ranks so that every rank takes the same decision; calls the policy; and
applies the difference through the C++ GeminiManager: optimizer state leaving the device first
(it frees device bytes), then the budget, then state joining the device. It warns with what the
policy found and logs each decision.
"""

from __future__ import annotations

import dataclasses
import time

from .. import allocator
from .._native import _C
from . import host_fit, host_memory, rates
from .._env import logger, warn_at_caller
from .costs import layout_figures
from .policies import Measurements, Placement, SetPlacement, warm_up_chunk_budget


class Placer:
    def __init__(self, policy, layout, device, groups):
        self.policy = policy
        self._layout = layout
        self._device = device  # ComputeDevice
        self._groups = groups  # DataParallelGroups
        self.current: Placement | None = None
        self._frozen = False
        self._accumulating = False  # no_sync() was entered in the iteration under way
        self._steps_during_backward = False  # the optimizer armed CPU steps during this backward
        self._host_steps = {"during_backward": "none", "why": "no backward yet"}  # the last backward's
        self._after_steps_done = False  # the policy wants no more after_step calls for this decision
        self._settled_step = None  # the last step's lanes, once settled (runtime.last_step), for after_step
        self._last_settled_step = None  # the same, kept: engine.stats()["lanes"]

    def note_accumulation(self) -> None:
        """Gradients of this iteration accumulate on the device (engine.no_sync)."""
        self._accumulating = True

    def note_backward_start(self, runtime) -> None:
        """A backward pass is about to begin, before the optimizer arms steps in it: the last
        step's lane figures are kept for after_step where every host set of that step was settled
        by the forward in between. Read at step() instead, they would be hidden by the steps this
        backward started (speculation: pending until the next forward) or restarted (the step in
        backward restarts the lanes' clocks)."""
        last = runtime.last_step()
        if last["pending_sets"] != 0:
            return
        host_work = last["host_params"] + last["link_params"]
        if host_work + last["device_params"] > 0:
            self._last_settled_step = last
        if self._settled_step is None and host_work > 0:
            self._settled_step = last

    def last_settled_step(self) -> dict | None:
        """The lane figures of the last step whose host steps had all finished when a backward began
        (runtime.last_step()); None before one did."""
        return self._last_settled_step

    def note_host_steps(self, cover: str, why: str, planned: str | None = None) -> None:
        """Which host sets' CPU steps of this iteration start during backward ("every set", "some
        sets" or "none") and why (optim/wrapper.py backward_started). The placement plans for the
        backward as their window only where every set's does; else for the next forward.
        `planned`: the cover the iterations after this one will have, where it differs (steps held
        back this once because the placement is decided at this iteration's end)."""
        self._steps_during_backward = (planned or cover) == "every set"
        self._host_steps = {"during_backward": cover, "why": why}

    def decides_at_iteration_end(self, runtime=None) -> bool:
        """Whether this iteration's end will decide the placement (the first iteration under a
        policy that decides from measurements, or one whose chunk accesses left the recorded order:
        its trace is re-recorded and the policy decides again, as after_iteration does): chunks may
        move before optimizer.step(), which would undo steps started during the backward."""
        if self._frozen or not self.policy.decides_after_iterations(self._device.kind):
            return False
        return not self.current.decision or (runtime is not None and runtime.trace_diverged())

    def freeze(self) -> None:
        """No later decisions: the optimizer state cannot move (a generically stepped optimizer's
        state is torch's own)."""
        self._frozen = True

    def _measure(self, **iteration) -> Measurements:
        available, source = None, None
        if self.policy.reads_host_memory:
            budget = host_memory.host_budget(self._groups.ranks_on_host())
            if budget is not None:
                available, source = budget.bytes, budget.source
                least = int(self._groups.reduce(available, "min"))  # every rank takes the same decision
                if least < available:
                    source = "the least of any rank's host budget"
                available = least
        return Measurements(
            device_kind=self._device.kind, allocator_mode=allocator.mode(),
            device_capacity_bytes=self._device.capacity_bytes(), **layout_figures(self._layout),
            sharded=self._groups.zero is not None, world_size=self._groups.world_size, host_available_bytes=available,
            host_budget_source=source, device_total_bytes=self._device.total_bytes(), **iteration)

    def _releasable_host_bytes(self) -> int:
        """The model's host tensors enable() releases as their values land in chunks: every
        parameter it manages, read before the fill."""
        return sum(p.numel() * p.element_size() for p in self._layout.params if p.device.type == "cpu")

    def initial(self) -> Placement:
        """The policy's placement before any memory is taken."""
        releasable = 0
        if self.policy.reads_host_memory:
            releasable = int(self._groups.reduce(self._releasable_host_bytes(), "min"))
        self.current = self.policy.initial(self._measure(host_releasable_bytes=releasable))
        self._check_host_holds(host_fit.enable_demand(self._layout, self.current, self._device.kind,
                                                      self._device.capacity_bytes()), "enable()", with_release=True)
        self._report(self.current)
        if self.policy.reads_rates:
            self._probe_rates()  # now, while nothing else runs (rates.py)
        return self.current

    def check_host_holds_optimizer_state(self, runtime, state_kinds: int) -> None:
        """Before an optimizer's state chunks get memory: the host holds them (host_fit.py)."""
        demand = host_fit.optimizer_demand(self._layout, runtime.set_placements(), state_kinds, self._device.kind,
                                           self._device.capacity_bytes())
        self._check_host_holds(demand, f"the optimizer's state ({state_kinds} kind(s) per parameter)",
                               with_release=False)

    def _check_host_holds(self, demand, what: str, with_release: bool) -> None:
        """host_fit.check over the least host budget of any rank (collective: every rank checks)."""
        budget = host_memory.host_budget(self._groups.ranks_on_host())
        available = None if budget is None else budget.bytes
        if with_release and available is not None:
            available += self._releasable_host_bytes()
        least = self._groups.reduce(available if available is not None else -1, "min")
        available = None if least < 0 else int(least)
        fixes = ("free host memory, use more data-parallel ranks (each holds 1/N of the chunks), keep the optimizer "
                 "state in bf16 (optimizer_state_dtype='bf16'), or train a smaller model")
        if self._device.kind == "sim" and host_fit.SIM_DEVICE_IS_HOST_MEMORY:
            fixes += ("; a smaller sim_capacity or gpu_memory_limit moves the sim device's chunks to the host tier "
                      "but does not lower the total, since the sim device is host memory")
        host_fit.check(demand, available, None if budget is None else budget.source, what,
                       fixes)

    def set_specs(self) -> list[dict]:
        """Per chunk set: its chunks and placement, as the GeminiManager takes them (the state
        chunks come with the optimizer)."""
        return [{"param": chunks.param, "grad": chunks.grad, "master": chunks.master, "states": [],
                 **dataclasses.asdict(place)} for chunks, place in zip(self._layout.sets, self.current.sets)]

    def device_first_chunks(self) -> tuple[list[int], list[int]]:
        """(chunks allocated on the device directly, gradient chunks without a copy yet). The
        optimizer state of the sets whose state starts on the device is allocated there, never
        on the host, and their gradients are born on the device. Where the plan says so, their
        parameter chunks are allocated on the device too (no host copy: the fill writes them there)."""
        first, grads = [], []
        for chunks, place in zip(self._layout.sets, self.current.sets):
            if chunks.trainable and not place.optim_on_host:
                first += [c for k, c in chunks.optimizer_side().items() if k != "grad"]
                grads.append(chunks.grad)
                if self.current.params_born_on_device:
                    first.append(chunks.param)
        return first, grads

    def after_iteration(self, runtime, tracer, report: dict) -> None:
        """Decides again after the first iteration and whenever the access trace was re-recorded
        (other control flow, sequence length, eval vs train), from the iteration just measured
        (`report`: GeminiManager.end_iteration's)."""
        accumulating = self._accumulating or self.policy.config.enable_gradient_accumulation
        self._accumulating = False
        settled, self._settled_step = self._settled_step, None
        if self._frozen or not self.policy.decides_after_iterations(self._device.kind):
            return
        rerecordings = report["trace_rerecordings"]
        if self.current.decision and rerecordings == self.current.decision["trace_rerecordings"]:
            self._after_step(runtime, tracer, rerecordings, settled)
            return
        figures = {k: int(self._groups.reduce(v, "max")) for k, v in tracer.last_device_figures().items()}
        if self.policy.reads_rates:
            figures.update(self._rates(tracer))
        measured = self._measure(trace_rerecordings=rerecordings, gradients_accumulate_on_device=accumulating,
                                 **figures)
        current = Placement(tuple(SetPlacement(p["optim_on_host"], p["param_home_on_host"], p["keep_gathered"],
                                               p["grad_stays_on_device"]) for p in runtime.set_placements()),
                            self.current.device_budget_bytes, self.current.decision,
                            link_sets=self.current.link_sets)
        chosen = self.policy.after_iteration(measured, current)
        self._apply(runtime, current, chosen)
        self.current = chosen
        self._after_steps_done = False
        self._report(chosen)

    def _after_step(self, runtime, tracer, rerecordings: int, last: dict | None) -> None:
        """Between decisions: the policy's look at the step under the current placement, from its
        lanes as they stood once every host set of it was settled (`last`: note_backward_start's,
        None where it was not settled), on every rank (optimizer_lanes.rebalanced_link_sets)."""
        if self._after_steps_done or not self._groups.all_agree(last is not None):
            return
        lanes = {"cpu_lane_elements_per_s_in_step": (last["host_params"], last["host_seconds"]),
                 "link_lane_elements_per_s_in_step": (last["link_params"], last["link_seconds"])}
        figures = {k: self._groups.reduce(n / s if n and s > 0 else 0.0, "min") for k, (n, s) in lanes.items()}
        figures["forward_optimizer_wait_seconds"] = self._groups.reduce(tracer.last_optimizer_wait_seconds(), "max")
        # Sets whose step ended in the backward: those started there whose guess held; a corrected,
        # redone or skipped one did its work at step(), in the forward's window.
        in_backward = last["guessed_sets"] - last["corrected_sets"] - last["redone_sets"] - last["skipped_sets"]
        figures["host_sets_stepped_in_backward"] = int(self._groups.reduce(in_backward, "min"))
        measured = self._measure(trace_rerecordings=rerecordings, **self._rates(tracer), **figures)
        chosen = self.policy.after_step(measured, self.current)
        if chosen is None:
            self._after_steps_done = True
            return
        if tuple(chosen.link_sets) != tuple(self.current.link_sets):
            runtime.set_link_sets(list(chosen.link_sets))
        self.current = chosen
        self._report(chosen)

    def _rates(self, tracer) -> dict:
        """What optimizer_split.py weighs, reduced so that every rank decides alike: the last
        forward and backward passes' durations, whether the CPU steps overlapped the backward, and
        the machine's measured rates. A probe that cannot run (no memory left for its buffers)
        reports 0: the policy then decides without rates."""
        cpu, h2d, link = self._probe_rates()
        passes = tracer.last_pass_seconds()
        return {"forward_seconds": self._groups.reduce(passes["forward_seconds"], "max"),
                "backward_seconds": self._groups.reduce(passes["backward_seconds"], "max"),
                "optimizer_steps_during_backward": bool(self._groups.all_agree(self._steps_during_backward)),
                "cpu_optimizer_elements_per_s": self._groups.reduce(cpu, "min"),
                "h2d_bytes_per_s": self._groups.reduce(h2d, "min"),
                "link_optimizer_elements_per_s": self._groups.reduce(link, "min")}

    def _probe_rates(self) -> tuple[float, float, float]:
        """(CPU optimizer elements/s, host-to-device bytes/s, link lane elements/s), probed once
        per process (rates.py); zeros where a probe cannot run (no memory left for its buffers)."""
        try:
            return (rates.cpu_optimizer_elements_per_s(), rates.h2d_bytes_per_s(self._device),
                    rates.link_optimizer_elements_per_s(self._device))
        except RuntimeError as e:  # out of device or pinned host memory for the probe's buffers
            logger.info("%s placement: the rate probes could not run (%s); deciding without rates",
                        self.policy.name, e)
            return 0.0, 0.0, 0.0

    def lower_budget_in_warm_up(self, runtime, other_bytes: int) -> int:
        """In the iteration before the first decision: lowers the chunks' device budget so that they and
        `other_bytes` of torch's (the activations the first block's measurement foresees) fit the
        device's capacity, never below three of the largest chunk sets (one computing, one fetched,
        one reduced). Returns the chunks' budget (0: the whole device)."""
        capacity = self._device.capacity_bytes()
        wanted = warm_up_chunk_budget(capacity, self._layout.shard_bytes, other_bytes)
        budget = self.current.device_budget_bytes or capacity
        if wanted < budget and not self.current.decision:
            self.current = dataclasses.replace(self.current, device_budget_bytes=wanted)
            runtime.set_device_budget(wanted)
        return self.current.device_budget_bytes

    def _apply(self, runtime, current: Placement, chosen: Placement) -> None:
        for k, (was, now) in enumerate(zip(current.sets, chosen.sets)):
            if dataclasses.replace(was, optim_on_host=now.optim_on_host) != now:
                raise _C.InternalError(f"gemini_ext internal error (this is a bug, please report it): policy "
                                       f"{self.policy.name!r} changed more than the optimizer state's tier of chunk "
                                       f"set {k} between iterations: {was} -> {now}")
        started = time.perf_counter()
        for k, (was, now) in enumerate(zip(current.sets, chosen.sets)):  # shrink first: frees device bytes
            if now.optim_on_host and not was.optim_on_host:
                runtime.set_optim_on_host(k, True)
        runtime.set_device_budget(chosen.device_budget_bytes)
        for k, (was, now) in enumerate(zip(current.sets, chosen.sets)):
            if was.optim_on_host and not now.optim_on_host:
                runtime.set_optim_on_host(k, False)
        if tuple(chosen.link_sets) != tuple(current.link_sets):
            runtime.set_link_sets(list(chosen.link_sets))
        if "move_seconds" in chosen.decision:
            chosen.decision["move_seconds"] = time.perf_counter() - started  # the state moved to its tiers

    def _report(self, placement: Placement) -> None:
        for message in placement.warnings:
            warn_at_caller(message)
        if placement.decision:
            logger.info("%s placement (decision %d): %s", self.policy.name, placement.decision["decisions"],
                        ", ".join(f"{k} {v}" for k, v in placement.decision.items() if k != "decisions"))
        elif placement.host_bound_sets:
            logger.info("%s placement: the host cannot hold every optimizer state; that of the first %d of %d chunk "
                        "sets starts on the device", self.policy.name, placement.host_bound_sets,
                        len(placement.sets))

    def summary(self, runtime) -> dict:
        """stats()["placement"]."""
        placements = runtime.set_placements()
        return {
            "policy": self.policy.name,
            "decision": dict(self.current.decision),
            "param_chunks_home_host": sum(p["param_home_on_host"] for p in placements),
            "optim_chunks_on_host": sum(p["trainable"] and p["optim_on_host"] for p in placements),
            "optim_chunks_on_device": sum(p["trainable"] and not p["optim_on_host"] for p in placements),
            "optim_chunks_link_lane": len(runtime.link_sets()) if self.current.link_sets else 0,
            "host_steps": dict(self._host_steps),  # which host sets' steps started in the last backward, why
        }
