"""The activations' budget as arithmetic over figures: what the first forward foresees, the room the
chunks leave and the plan over it. The planner (planner.py) calls these with what it measured;
gx.estimate calls the same functions with what it predicts, so a change here changes both. The
decision itself is the core's (core/activation_plan.h); see [Note: the room, and the budget kept]
(planner.py) for why the room is what it is.
"""

from __future__ import annotations

import dataclasses

from ..._native import _C
from .offload import LOOKAHEAD

WARM_UP_MARGIN = 1.5  # the first iteration's activations beyond the plan's figure (gradients, the loss, the head)


@dataclasses.dataclass(frozen=True)
class Allowed:
    """What a plan may choose per block under the config, and what the measured forward runs."""
    keep: bool  # only where the engine decides the checkpointing (activation_checkpointing="auto")
    recompute: bool  # plain recompute, unless every checkpointed block's input goes to the host
    warm_choice: str  # the measured forward's choice for every block: the least device memory allowed

    @classmethod
    def of(cls, checkpointing: str, offload: str) -> "Allowed":
        return cls(keep=checkpointing == "auto", recompute=offload != "on",
                   warm_choice="offload" if offload != "off" else "recompute")


def warm_choices(num_blocks: int, warm_choice: str, input_bytes: int, host_free_bytes: int) -> list[str]:
    """The measured forward's choices, every block taken as block 0: the inputs the host has room for
    offloaded (host_free_bytes -1: no limit known), the others kept on the device (recomputed)."""
    offloaded = num_blocks if warm_choice == "offload" else 0
    if offloaded and host_free_bytes >= 0 and input_bytes > 0:
        offloaded = min(num_blocks, host_free_bytes // input_bytes)
    return ["offload"] * offloaded + ["recompute"] * (num_blocks - offloaded)


def warm_device_bytes(num_blocks: int, warm_choice: str, activation_bytes: int, input_bytes: int,
                      host_free_bytes: int) -> int:
    """What the measured forward's choices need on the device, every block taken as block 0."""
    choices = warm_choices(num_blocks, warm_choice, input_bytes, host_free_bytes)
    return device_bytes([(activation_bytes, input_bytes, 0.0, 0.0)] * num_blocks, choices)


def device_bytes(blocks: list, choices: list[str]) -> int:
    """The device peak of `blocks` ((activation bytes, input bytes, forward s, backward s) each) run
    with `choices`: the core's figure, the plan's own."""
    return _C.activation_device_bytes(blocks, choices, LOOKAHEAD)


def measured_forward_bytes(blocks: list, warm_choice: str) -> int:
    """What the room counts the measured forward's blocks as having needed: every block as measured,
    run with the warm choice (the plan's least)."""
    return device_bytes(blocks, [warm_choice] * len(blocks))


def foreseen_warm_up_bytes(warm_bytes: int) -> int:
    """What the first iteration is given room for beside the chunks, from the plan's figure."""
    return int(warm_bytes * WARM_UP_MARGIN)


# Where the loss is computed after the forward, what it allocates then per element of the model's
# largest floating output (the logits): the fp32 copy transformers' losses make, what cross-entropy
# saves, and the gradient over them, 4 bytes an element each.
LOSS_OUTSIDE_FORWARD_BYTES_PER_ELEMENT = 3 * 4


def foreseen_loss_bytes(head_bytes: int, largest_output_elements: int, loss_in_output: bool) -> int:
    """What the first backward allocates beyond the forward's end for the head and the loss: as much as
    the forward allocated after its last block (the logits, their fp32 copy, what the loss saved: the
    gradients mirror them), or where the loss is not in the output, what computing it over the largest
    output takes (LOSS_OUTSIDE_FORWARD_BYTES_PER_ELEMENT), whichever is more."""
    outside = 0 if loss_in_output else largest_output_elements * LOSS_OUTSIDE_FORWARD_BYTES_PER_ELEMENT
    return max(head_bytes, outside)


def warm_up_refused(need_bytes: int, capacity_bytes: int, total_bytes: int, chunk_floor_bytes: int) -> bool:
    """Whether the first iteration cannot keep a gpu_memory_limit: `need_bytes` (torch's memory so far
    and the foreseen activations) beyond what three chunk sets leave of it."""
    return total_bytes > capacity_bytes and need_bytes > capacity_bytes - chunk_floor_bytes


def warm_up_need(warm_bytes: int, held_bytes: int, outside_bytes: int, capacity_bytes: int, total_bytes: int,
                 chunk_floor_bytes: int) -> tuple[int, int, bool]:
    """The first forward's device need once block 0 is measured: (what is foreseen for the warm-up's
    activations, that beside torch's `held_bytes` and the `outside_bytes` outside torch, and whether
    a gpu_memory_limit refuses it). The engine's first-block hook and the estimate both decide here."""
    foreseen = foreseen_warm_up_bytes(warm_bytes)
    need = held_bytes + outside_bytes + foreseen
    return foreseen, need, warm_up_refused(need, capacity_bytes, total_bytes, chunk_floor_bytes)


def chunk_need_bytes(device_budget_bytes: int | None, capacity_bytes: int, chunk_bytes: int) -> int:
    """The device bytes the chunks may take: the placement's budget (None or 0: the whole capacity), or
    every chunk's bytes where fewer."""
    return min(device_budget_bytes or capacity_bytes, chunk_bytes)


def device_free_bytes(capacity_bytes: int, chunk_need: int, figures: dict, warm_activation_bytes: int) -> int:
    """Device bytes the activations may take, from the first iteration's `figures` (the tracer's
    non_model_peak_bytes, non_model_reserved_bytes, device_other_bytes) and what its measured forward's
    choices needed (see [Note: the room, and the budget kept]). What the device holds outside torch
    counts against the capacity, as the placement counts it (the Note on safety margins)."""
    other_non_model = max(0, figures["non_model_peak_bytes"] - warm_activation_bytes)
    # torch's allocator holds more than the peak it hands out, as much more as the first iteration showed
    held = max(1.0, figures["non_model_reserved_bytes"] / max(1, figures["non_model_peak_bytes"]))
    free = capacity_bytes - chunk_need - figures["device_other_bytes"]
    return int(free / held) - other_non_model


def plan(blocks: list, free_bytes: int, link_bytes_per_s: float, allowed: Allowed, host_free_bytes: int) -> dict:
    """The core's per-block plan (keep, recompute, offload) of `blocks` ((activation bytes, input bytes,
    forward s, backward s) each) within `room` device bytes."""
    return _C.plan_activations(blocks, max(0, free_bytes), link_bytes_per_s, LOOKAHEAD, allow_keep=allowed.keep,
                               allow_recompute=allowed.recompute, host_free_bytes=host_free_bytes)
