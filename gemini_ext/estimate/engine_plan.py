"""The engine's decisions made without memory. gx.estimate's layout, placement and activation plan
are the engine's own code, fed figures predicted where the engine measures them:

- the chunk layout enable() builds (on a simulated device: nothing is allocated) and the placement
  measurements it fixes (placement/costs.layout_figures);
- the placement policy's plan before any memory (policy.initial);
- the first forward: block 0 measured, and the chunks' budget lowered for what it foresees
  (activations/budget.py, placement's warm_up_chunk_budget), or refused where even three chunk sets
  would not leave that room under a gpu_memory_limit;
- the policy's decision after the first iteration, from its non-model peak (policy.after_iteration);
- the activation plan over the room that decision leaves (activations/budget.py, the core's plan).

The figures are shape.py's predictions, or those an engine recorded (`recorded`): given the same
figures the decisions are the engine's, which is what the map's recorded rows test.
"""

from __future__ import annotations

import dataclasses

import torch

from .._engine.activations import budget
from .._engine.activations.host_buffers import RESERVE_BYTES
from .._engine.layout import STATE_DTYPES, ChunkLayout
from .._native import _C
from ..optim.rules import MAX_STATE_KINDS
from ..placement import host_fit
from ..placement.chunk_floor import chunk_floor_bytes
from ..placement.costs import layout_figures
from ..placement.policies import Measurements, make_policy, warm_up_chunk_budget
from . import target

SIM_CAPACITY = 1 << 50  # the layout's simulated device: nothing is allocated on it
RECORDED_FIGURES = ("non_model_peak_bytes", "non_model_reserved_bytes", "device_other_bytes",  # the tracer's
                    "block0_activation_bytes", "block0_input_bytes",  # the first block's measurement
                    # the planner's measured blocks, its device room and the host's
                    "blocks", "activation_free_bytes", "host_free_bytes", "link_bytes_per_s",
                    # what the placement weighed (its decision records them)
                    "forward_seconds", "backward_seconds", "cpu_optimizer_elements_per_s", "h2d_bytes_per_s",
                    "link_optimizer_elements_per_s", "optimizer_steps_during_backward")
PASS_FIGURES = RECORDED_FIGURES[-6:]


@dataclasses.dataclass(frozen=True)
class Machine:
    capacity_bytes: int  # gpu_memory_limit, or the whole device
    total_bytes: int  # the whole device
    world_size: int
    host_available_bytes: int | None  # each rank's; None: unknown
    host_source: str | None


@dataclasses.dataclass(frozen=True)
class Activations:
    """The first iteration's activations as the engine would see them: per block (activation bytes,
    input bytes, forward s, backward s), the non-model bytes beyond the blocks' (the loss's logits),
    the choices the config fixes (None: planned), and figures an engine recorded, which win."""
    blocks: list
    outside_blocks_bytes: int
    fixed_choice: str | None
    allowed: budget.Allowed | None
    recorded: dict = dataclasses.field(default_factory=dict)


def build_layout(named, config, compute_dtype, chunk_size: int, world_size: int) -> ChunkLayout:
    """The chunk layout enable() builds, on a simulated device that allocates nothing."""
    context = _C.DeviceContext("sim", capacity_bytes=SIM_CAPACITY, sim_max_copy_delay_us=0, sim_seed=1)
    chunks = _C.ChunkManager(context, world_size=world_size, rank=0, pin_memory=False)
    return ChunkLayout(chunks, named, compute_dtype, torch.device("cpu"), MAX_STATE_KINDS, chunk_size,
                       STATE_DTYPES[config.optimizer_state_dtype], config.master_weights)


def base_measurements(layout, machine: Machine, releasable_bytes: int) -> dict:
    """What the placement reads before any iteration, as the Placer gathers it on cuda."""
    return dict(device_kind="cuda", allocator_mode="default", device_capacity_bytes=machine.capacity_bytes,
                device_total_bytes=machine.total_bytes, **layout_figures(layout), sharded=machine.world_size > 1,
                world_size=machine.world_size, host_available_bytes=machine.host_available_bytes,
                host_budget_source=machine.host_source, host_releasable_bytes=releasable_bytes)


def initial_placement(policy, base: dict):
    """The policy's plan before the first iteration. Where the host is too small for what the device
    cannot take either (enable() would raise), the plan of a host with room, which the summary then
    reports as not fitting this one."""
    try:
        return policy.initial(Measurements(**base))
    except _C.OutOfMemoryError:
        if base["host_available_bytes"] is None:
            raise
        return policy.initial(Measurements(**{**base, "host_available_bytes": None}))


def device_state_elements(m: Measurements, placement) -> tuple[list, list]:
    """(elements per set, whether its optimizer state is on the host) under `placement`."""
    elements = [b // m.compute_itemsize for b in m.set_shard_bytes]
    return elements, [s.optim_on_host and t for s, t in zip(placement.sets, m.trainable)]


def chunk_bytes(m: Measurements, placement, on_device_only: bool) -> int:
    """The chunks' bytes: parameters and the optimizer side of every trainable set, or only of those
    whose state is on the device."""
    elements, on_host = device_state_elements(m, placement)
    state = sum(n for n, h, t in zip(elements, on_host, m.trainable) if t and not (on_device_only and h))
    return sum(m.set_shard_bytes) + state * m.set_bytes_per_element


def displaced_param_bytes(m: Measurements, placement) -> int:
    """Parameter bytes the chunks' budget cannot hold beside the device-held state: evicted and fetched again."""
    budget_bytes = placement.device_budget_bytes or m.device_capacity_bytes
    return max(0, chunk_bytes(m, placement, on_device_only=True) - budget_bytes)


def host_free_bytes(m: Measurements, held_bytes: int, acts: Activations) -> int:
    """What offloaded inputs may take of the host (HostBuffers.free_bytes): what it has beyond the
    chunks' share `held_bytes` (host_fit.plan_host_bytes) and the buffers' reserve; -1 where the host is unknown."""
    if "host_free_bytes" in acts.recorded:
        return int(acts.recorded["host_free_bytes"])
    if m.host_available_bytes is None:
        return -1
    return max(0, m.host_available_bytes + m.host_releasable_bytes - held_bytes - RESERVE_BYTES)


def _block0(acts: Activations) -> tuple[int, int]:
    activation, inputs = acts.blocks[0][0], acts.blocks[0][1]
    return (int(acts.recorded.get("block0_activation_bytes", activation)),
            int(acts.recorded.get("block0_input_bytes", inputs)))


def warm_up(m: Measurements, placement, held_bytes: int, acts: Activations, machine: Machine) -> dict:
    """The first forward once block 0 is measured (the activation manager's first-block hook): what it foresees, the
    chunks' budget it leaves, and whether a gpu_memory_limit refuses it."""
    activation, inputs = _block0(acts)
    warm = budget.warm_device_bytes(len(acts.blocks), acts.allowed.warm_choice, activation, inputs,
                                    host_free_bytes(m, held_bytes, acts))
    held = inputs  # what torch holds then: the batch's embedding, block 0's input
    outside = int(acts.recorded.get("device_other_bytes", target.DEVICE_OTHER_BYTES))  # the CUDA context
    _, need, refused = budget.warm_up_need(warm, held, outside, machine.capacity_bytes, machine.total_bytes,
                                           chunk_floor_bytes(m.set_shard_bytes))
    current = placement.device_budget_bytes or machine.capacity_bytes
    return {"foreseen_bytes": need, "refused": refused,
            "chunk_budget_bytes": min(current, warm_up_chunk_budget(machine.capacity_bytes, m.set_shard_bytes, need))}


def first_iteration_figures(m: Measurements, held_bytes: int, acts: Activations) -> dict:
    """The tracer's figures of the first iteration: the blocks run with the least device memory the
    plan allows (their inputs offloaded where the host has room), or as the config fixes them."""
    if acts.fixed_choice is not None:
        warm = budget.device_bytes(acts.blocks, [acts.fixed_choice] * len(acts.blocks))
    else:
        warm = budget.device_bytes(acts.blocks, budget.warm_choices(
            len(acts.blocks), acts.allowed.warm_choice, acts.blocks[0][1],
            host_free_bytes(m, held_bytes, acts)))
    peak = int(acts.recorded.get("non_model_peak_bytes", warm + acts.outside_blocks_bytes))
    figures = {"non_model_peak_bytes": peak,
               "non_model_reserved_bytes": int(acts.recorded.get("non_model_reserved_bytes",
                                                                 peak * target.ACTIVATION_RESERVE_RATIO)),
               "device_other_bytes": int(acts.recorded.get("device_other_bytes", target.DEVICE_OTHER_BYTES))}
    return figures


def activation_plan(m: Measurements, chosen, held_bytes: int, acts: Activations, figures: dict, offload: bool) -> dict:
    """The planner's plan after the first iteration, over the room the chosen placement leaves."""
    blocks = [tuple(b) for b in acts.recorded.get("blocks", acts.blocks)]
    warm_bytes = budget.measured_forward_bytes(blocks, acts.allowed.warm_choice)
    need = budget.chunk_need_bytes(chosen.device_budget_bytes, m.device_capacity_bytes,
                                   chunk_bytes(m, chosen, on_device_only=False))
    # The engine plans at the end of its first iteration, from that iteration's figures; a placement
    # decided again later (its trace recorded anew) measures others, so a recorded room is the plan's own.
    free_bytes = int(acts.recorded["activation_free_bytes"]) if "activation_free_bytes" in acts.recorded else \
        budget.device_free_bytes(m.device_capacity_bytes, need, figures, warm_bytes)
    link = float(acts.recorded.get("link_bytes_per_s", target.H2D_BYTES_PER_S)) if offload else 0.0
    host_free = host_free_bytes(m, held_bytes, acts)
    return {**budget.plan(blocks, free_bytes, link, acts.allowed, host_free), "device_free_bytes": free_bytes,
            "link_bytes_per_s": link, "host_free_bytes": host_free}


def plan(config, layout, machine: Machine, releasable_bytes: int, acts: Activations | None, passes: dict,
         fixed_peak_bytes: int = 0) -> dict:
    """The engine's decisions in its order (the module's note). `passes`: the first iteration's
    forward_seconds and backward_seconds and the CPU rate, which the policy weighs. Without `acts`
    the first iteration's non-model peak is `fixed_peak_bytes`."""
    base = base_measurements(layout, machine, releasable_bytes)
    policy = make_policy(config)
    initial = initial_placement(policy, base)
    m0 = Measurements(**base)
    kinds = layout.planned_state_kinds
    initial_host_bytes = host_fit.plan_host_bytes(layout, initial, kinds)
    warm = None
    if acts is not None and acts.fixed_choice is None:
        warm = warm_up(m0, initial, initial_host_bytes, acts, machine)
        initial = dataclasses.replace(initial, device_budget_bytes=warm["chunk_budget_bytes"])
    figures = first_iteration_figures(m0, initial_host_bytes, acts) if acts is not None else {
        "non_model_peak_bytes": fixed_peak_bytes,
        "non_model_reserved_bytes": int(fixed_peak_bytes * target.ACTIVATION_RESERVE_RATIO),
        "device_other_bytes": target.DEVICE_OTHER_BYTES}
    rates = {"h2d_bytes_per_s": target.H2D_BYTES_PER_S, "link_optimizer_elements_per_s": target.LINK_ELEMENTS_PER_S,
             **passes, **{k: v for k, v in (acts.recorded if acts else {}).items() if k in PASS_FIGURES}}
    rates.setdefault("optimizer_steps_during_backward", config.optimizer_step_in_backward)
    measured = Measurements(**base, **figures, **rates)
    chosen = policy.after_iteration(measured, initial) if policy.decides_after_iterations("cuda") else initial
    # the parameters' birth is enable()'s, from the initial plan
    host_bytes = host_fit.plan_host_bytes(
        layout, dataclasses.replace(chosen, params_born_on_device=initial.params_born_on_device), kinds)
    activations = None
    if acts is not None and acts.fixed_choice is None:
        activations = activation_plan(measured, chosen, host_bytes, acts, figures, config.activation_offload != "off")
    return {"measured": measured, "initial": initial, "chosen": chosen, "warm_up": warm, "first_figures": figures,
            "activation_plan": activations, "host_chunk_bytes": host_bytes}
