"""ActivationPlanner: where `activation_checkpointing` or `activation_offload` is "auto", measures
the blocks in the first forward and has the core choose per block (core/activation_plan.h): keep
its activations (checkpointing "auto" only), recompute them (unless offload is "on"), or recompute
them with the input offloaded (unless offload is "off").

[Note: what is measured, and the room]
- The first forward with grad runs every block checkpointed (inputs offloaded where offload is on):
  the least device memory, so the warm-up fits wherever the plan will. It records each block's
  input bytes (its tensor arguments) and forward time (CUDA events on cuda, the host clock on
  sim), and runs block 0 without checkpointing under saved-tensor hooks that count what it saves
  (distinct storages, parameters left out): its activations. Blocks repeat, so block i's
  activations are taken as block 0's scaled by their inputs; its backward as twice its forward.
- The room is what the chunks leave: the device capacity less the chunks' need (the placement's
  device budget, or every chunk's bytes where fewer), less what the device holds besides (torch's
  context), shrunk by how much more than its peak torch's allocator held in the first iteration,
  less the non-model peak of that iteration without its activations (the plan's own figure for
  the warm-up's choices). Chunks come first: activations take what they do not use.
- The plan is made once, after the first iteration, and applied from the next forward on.
"""

from __future__ import annotations

import time
import warnings

import torch

from .._native import _C
from .._units import format_bytes
from ..placement import rates
from .activation_offload import LOOKAHEAD

BACKWARD_PER_FORWARD = 2.0


class BlockProbe:
    """Runs the blocks of the measured forward (BlockCheckpointing.probe)."""

    def __init__(self, num_blocks: int, device: torch.device, offload: bool):
        self._cuda = device.type == "cuda"
        self._offload = offload
        self.input_bytes = [0] * num_blocks
        self._marks: list = [None] * num_blocks
        self.block0_activation_bytes = 0
        self.ran = False

    def run(self, index, original, args, kwargs, blocks):
        self.ran = True
        self.input_bytes[index] = sum(t.numel() * t.element_size() for t in args
                                      if isinstance(t, torch.Tensor) and t.is_floating_point())
        start = self._mark()
        if index == 0:
            seen: dict = {}
            with torch.autograd.graph.saved_tensors_hooks(lambda t: _count(seen, t), lambda t: t):
                out = blocks.kept(original, args, kwargs)
            self.block0_activation_bytes = sum(seen.values())
        else:
            out = blocks.checkpointed(original, args, kwargs, offload=self._offload)
        self._marks[index] = (start, self._mark())
        return out

    def _mark(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def forward_seconds(self) -> list[float]:
        if self._cuda:
            torch.cuda.synchronize()
        return [0.0 if mark is None else self._elapsed(*mark) for mark in self._marks]

    def _elapsed(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self._cuda else end - start

    def blocks(self) -> list[tuple]:
        """(activation_bytes, input_bytes, forward_seconds, backward_seconds) per block."""
        first = self.input_bytes[0]
        out = []
        for inputs, forward in zip(self.input_bytes, self.forward_seconds()):
            activations = self.block0_activation_bytes * inputs // first if first else self.block0_activation_bytes
            out.append((int(activations), int(inputs), forward, BACKWARD_PER_FORWARD * forward))
        return out


def _count(seen: dict, tensor: torch.Tensor):
    if not (tensor.is_leaf and tensor.requires_grad):  # parameters stay in their chunks
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return tensor


class ActivationPlanner:
    """Measures the first forward, then sets the blocks' choices once."""

    def __init__(self, blocks, device, chunks, placer, tracer, checkpointing: str, offload: str,
                 host_buffers=None):
        self._blocks, self._device, self._chunks = blocks, device, chunks
        self._host_buffers = host_buffers  # where offloaded inputs go (HostBuffers), None without offload
        self._placer, self._tracer = placer, tracer
        self._offload = offload != "off"
        # what the plan may choose: keep only where the engine decides the checkpointing; plain
        # recompute unless every checkpointed block's input goes to the host
        self._allow_keep = checkpointing == "auto"
        self._allow_recompute = offload != "on"
        self._probe = BlockProbe(blocks.num_blocks, device.torch_device, self._offload)
        blocks.probe = self._probe
        self.plan: dict | None = None
        self.measured: list = []  # (activation_bytes, input_bytes, forward_s, backward_s) per block, once measured

    def after_iteration(self) -> None:
        if self.plan is not None or not self._probe.ran:
            return
        self._blocks.probe = None
        self.measured = measured = self._probe.blocks()
        warm = ["keep"] + ["offload" if self._offload else "recompute"] * (len(measured) - 1)
        warm_bytes = _C.activation_device_bytes(measured, warm, LOOKAHEAD)
        room = self.room_bytes(warm_bytes)
        link = rates.h2d_bytes_per_s(self._device) if self._offload else 0.0
        host_room = self._host_buffers.room_bytes() if self._host_buffers is not None else -1
        plan = _C.plan_activations(measured, max(0, room), link, LOOKAHEAD, allow_keep=self._allow_keep,
                                   allow_recompute=self._allow_recompute, host_room_bytes=host_room)
        self._blocks.choices = plan["choices"]
        self.plan = {**plan, "room_bytes": room, "link_bytes_per_s": link, "host_room_bytes": host_room}
        if not plan["fits"]:
            warnings.warn(self._beyond_the_room_message(), RuntimeWarning, stacklevel=2)

    def _beyond_the_room_message(self) -> str:
        plan, b = self.plan, format_bytes
        host = (f"; the host has room for {b(plan['host_room_bytes'])} of offloaded inputs and they take "
                f"{b(plan['host_bytes'])}" if plan["host_room_bytes"] >= 0 else "")
        offload = "" if self._offload else ", set activation_offload='auto'"
        return (f"gemini_ext: the activations of {len(plan['choices'])} blocks need {b(plan['device_bytes'])} of "
                f"the device at their least, beyond the {b(max(0, plan['room_bytes']))} that the chunks leave "
                f"within the device budget{host}; the device will hold more than gpu_memory_limit plans for. "
                f"Raise gpu_memory_limit, train on fewer tokens per step{offload} or free host memory.")

    def room_bytes(self, warm_activation_bytes: int) -> int:
        """Device bytes the activations may take (the module's note)."""
        figures = self._tracer.last_device_figures()
        chunk_bytes = sum(self._chunks.tier_bytes(t)["current"] for t in ("device", "pinned_host", "pageable_host"))
        budget = self._placer.current.device_budget_bytes or self._device.capacity_bytes()
        other_non_model = max(0, figures["non_model_peak_bytes"] - warm_activation_bytes)
        chunk_need = min(budget, chunk_bytes)
        # torch's allocator holds more than the peak it hands out, as much more as the first iteration showed
        held = max(1.0, figures["non_model_reserved_bytes"] / max(1, figures["non_model_peak_bytes"]))
        free = self._device.capacity_bytes() - chunk_need - figures["device_other_bytes"]
        return int(free / held) - other_non_model

    def stats(self) -> dict:
        if self.plan is None:
            return {"decided": False}
        choices = self.plan["choices"]
        return {"decided": True, **{c: choices.count(c) for c in ("keep", "recompute", "offload")},
                "choices": list(choices), "room_bytes": self.plan["room_bytes"],
                "planned_device_bytes": self.plan["device_bytes"], "added_seconds": self.plan["added_seconds"],
                "fits": self.plan["fits"], "link_bytes_per_s": self.plan["link_bytes_per_s"],
                "host_bytes": self.plan["host_bytes"], "host_room_bytes": self.plan["host_room_bytes"]}
