"""ActivationPlanner: where `activation_checkpointing` or `activation_offload` is "auto", has the
core choose per block (core/activation_plan.h) from the first forward's measurements (probe.py):
keep its activations (checkpointing "auto" only), recompute them (unless offload is "on"), or
recompute them with the input offloaded (unless offload is "off").

[Note: the room, and the budget kept]
- The room is what the chunks leave: the device capacity less the chunks' need (the placement's
  device budget, or every chunk's bytes where fewer), less what the device holds besides (the
  CUDA context and the libraries' workspaces, on the whole device and under a gpu_memory_limit
  alike, as the placement counts it: a limit is what a card of that size holds), shrunk by how
  much more than its peak torch's allocator held in the first iteration, less the non-model peak
  of that iteration without its activations (the plan's own figure for the measured forward's
  choices, the least it allows). Chunks come first: activations take what they do not use.
- The plan is made once, after the first iteration, and applied from the next forward on. Where
  even the least plan exceeds the room, `refusal` says by how much and what would fit (the tokens
  per step, or the gpu_memory_limit), and on cuda the room raises it at the next forward instead
  of running over the budget. On sim, whose device does not hold torch's activations (they are
  host tensors), it is a warning.
"""

from __future__ import annotations

import warnings

from ..._units import format_bytes
from ...placement import rates
from . import budget
from .probe import BlockProbe


class ActivationPlanner:
    """Measures the first forward (through the blocks' probe), then sets the blocks' choices once."""

    REFUSING_DEVICES = ("cuda",)  # where a plan beyond the room is refused rather than warned of

    def __init__(self, blocks, device, chunks, placer, tracer, checkpointing: str, offload: str,
                 host_buffers=None):
        self._blocks, self._device, self._chunks = blocks, device, chunks
        self._host_buffers = host_buffers  # where offloaded inputs go (HostBuffers), None without offload
        self._placer, self._tracer = placer, tracer
        self._offload = offload != "off"
        self._allowed = budget.Allowed.of(checkpointing, offload)
        self._probe = BlockProbe(blocks.num_blocks, device.torch_device, self._allowed.warm_choice)
        blocks.probe = self._probe
        self.plan: dict | None = None
        self.refusal: str | None = None  # where no plan fits: what the next forward raises
        self.measured: list = []  # (activation_bytes, input_bytes, forward_s, backward_s) per block, once measured

    def warm_device_bytes(self, activation_bytes: int, input_bytes: int) -> int:
        """What the measured forward's choices need on the device, every block taken as block 0: the
        inputs the host has room for offloaded, the others kept on the device (recomputed)."""
        return budget.warm_device_bytes(self._blocks.num_blocks, self._allowed.warm_choice, activation_bytes,
                                        input_bytes, self.host_free_bytes())

    def host_free_bytes(self) -> int:
        """What offloaded inputs may take of the host (-1: no limit known, or no offload)."""
        return self._host_buffers.free_bytes() if self._host_buffers is not None else -1

    def warm_up_refusal(self, need_bytes: int, device_free_bytes: int) -> str:
        """Why the first iteration cannot keep the budget: its activations, foreseen from block 0,
        need `need_bytes` beside the least the chunks need, and the device budget leaves `device_free_bytes`."""
        b, tokens = format_bytes, self._probe.tokens
        over = need_bytes - device_free_bytes
        most = tokens * max(0, device_free_bytes) // max(1, need_bytes)
        fit = (f"train on at most about {most:,} tokens per step (this "
               f"step has {tokens:,}), " if tokens else "train on fewer tokens per step, ")
        return (f"gemini_ext: block 0 of {self._blocks.num_blocks} measured at the first forward foresees "
                f"{b(need_bytes)} of activations on the device at their least (its own recomputed, the inputs the "
                f"host cannot take kept; torch's memory so far and the memory outside torch included), {b(over)} "
                f"more than the {b(device_free_bytes)} the device budget ({b(self._device.capacity_bytes())}) leaves "
                f"beside "
                f"three chunk sets. The engine keeps the budget rather than run over it: {fit}raise "
                f"gpu_memory_limit by at least {b(over)}, or free host memory for offloaded inputs.")

    @property
    def probe(self) -> BlockProbe:
        return self._probe

    def after_iteration(self) -> None:
        if self.plan is not None or not self._probe.ran:
            return
        self._blocks.probe = None
        self.measured = measured = self._probe.blocks()  # see [Note: what is measured] (probe.py)
        warm_bytes = budget.measured_forward_bytes(measured, self._allowed.warm_choice)
        free_bytes = self.device_free_bytes(warm_bytes)
        link = rates.h2d_bytes_per_s(self._device) if self._offload else 0.0
        host_free = self.host_free_bytes()
        plan = budget.plan(measured, free_bytes, link, self._allowed, host_free)
        self._blocks.choices = plan["choices"]
        self.plan = {**plan, "device_free_bytes": free_bytes, "link_bytes_per_s": link, "host_free_bytes": host_free}
        if not plan["fits"]:
            message = self._beyond_the_budget_message()
            if self._device.kind in self.REFUSING_DEVICES:
                self.refusal = message
            else:
                warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _beyond_the_budget_message(self) -> str:
        plan, b = self.plan, format_bytes
        free_bytes = max(0, plan["device_free_bytes"])
        over = plan["device_bytes"] - free_bytes
        host = (f"; the host has room for {b(plan['host_free_bytes'])} of offloaded inputs and they take "
                f"{b(plan['host_bytes'])}" if plan["host_free_bytes"] >= 0 else "")
        offload = "" if self._offload else " or set activation_offload='auto'"
        tokens = self._probe.tokens
        most = tokens * free_bytes // max(1, plan['device_bytes'])
        fit = (f"train on at most about {most:,} tokens per step (this step "
               f"had {tokens:,}), " if tokens else "train on fewer tokens per step, ")
        return (f"gemini_ext: the activations of {len(plan['choices'])} blocks need {b(plan['device_bytes'])} of "
                f"the device at their least, {b(over)} more than the {b(free_bytes)} that the chunks leave within the "
                f"device budget ({b(self._device.capacity_bytes())}){host}. The engine keeps the budget rather than "
                f"run over it: {fit}raise gpu_memory_limit by at least {b(over)}{offload}, or free host memory.")

    def chunk_need_bytes(self) -> int:
        """The device bytes the chunks may take: the placement's budget, or every chunk's bytes where fewer."""
        chunk_bytes = sum(self._chunks.tier_bytes(t)["current"] for t in ("device", "pinned_host", "pageable_host"))
        return budget.chunk_need_bytes(self._placer.current.device_budget_bytes, self._device.capacity_bytes(),
                                       chunk_bytes)

    def device_free_bytes(self, warm_activation_bytes: int) -> int:
        """Device bytes the activations may take (see [Note: the room, and the budget kept])."""
        return budget.device_free_bytes(self._device.capacity_bytes(), self.chunk_need_bytes(),
                                 self._tracer.last_device_figures(), warm_activation_bytes)

    def outside_torch_bytes(self) -> int:
        """The device's memory outside torch and the chunks at the last iteration's end (the tracer's)."""
        return self._tracer.last_device_figures()["device_other_bytes"]

    def detach(self) -> None:
        """Lets go of the chunks, the placer and the tracer (the engine closes)."""
        self._chunks = self._placer = self._tracer = None

    def stats(self) -> dict:
        if self.plan is None:
            return {"decided": False}
        choices = self.plan["choices"]
        return {"decided": True, **{c: choices.count(c) for c in ("keep", "recompute", "offload")},
                "choices": list(choices), "device_free_bytes": self.plan["device_free_bytes"],
                "planned_device_bytes": self.plan["device_bytes"], "added_seconds": self.plan["added_seconds"],
                "fits": self.plan["fits"], "link_bytes_per_s": self.plan["link_bytes_per_s"],
                "host_bytes": self.plan["host_bytes"], "host_free_bytes": self.plan["host_free_bytes"],
                "measured_tokens": self._probe.tokens,
                # per block (activation bytes, input bytes, forward s, backward s), as the plan took them
                "measured_blocks": [list(b) for b in self.measured]}
