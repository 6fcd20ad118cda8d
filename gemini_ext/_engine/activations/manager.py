"""ActivationManager: what the engine does with activations, as one part of the engine: the blocks and
how each runs (blocks.py), the checkpoint calls the model makes (calls.py), the offload to host
memory (offload.py, host_buffers.py) and the plan (planner.py, probe.py; the decision is the
core's, core/activation_plan.h). The engine holds only the room; the parts get the collaborators
they use, and the manager's hooks over the model's forward are the only place they meet.

[Note: the root forward]
- Before the model's forward: the checkpoint functions the model carries are wrapped (a function
  set since, as the Trainer's `gradient_checkpointing_enable()`, is wrapped before it runs); a plan
  that could not fit the budget is raised (planner.py); the offload's saved-tensor hooks are
  entered.
- After the first iteration's forward, where torch is capped: the head's and the loss's backward is
  foreseen from what the forward allocated after its last block and from its largest output (the
  logits; budget.foreseen_loss_bytes), and where torch's cap would not hold it beside what torch
  holds, the chunks' budget is lowered again before the backward, so that the gradient of large
  logits is not an out-of-memory the limit made.
- After it: the offload's hooks are left; where offload is "on" without the engine's checkpointing
  and a forward with grad made no checkpoint call the engine can see, it warns once that nothing
  went to the host.
- The first iteration, once block 0 is measured (probe.py) and before any other block runs: the
  chunks' budget is lowered (placer.lower_budget_in_warm_up) so that they, what torch holds already,
  what the device holds outside torch (allocator.outside_torch_bytes) and budget.WARM_UP_MARGIN
  times what the measured forward's choices foresee for the activations fit the device budget.
- After each iteration (the optimizer's step): the plan is made once from the first iteration's
  measurements.
- Where the engine plans activations on cuda under a gpu_memory_limit, torch's caching allocator is
  capped at what the chunks' budget and the memory outside torch leave of the limit
  (torch.cuda.set_per_process_memory_fraction),
  from the first block's measurement on and again after every iteration, so chunks plus torch's
  reserved memory stay within the limit: an allocation beyond it is torch's OutOfMemoryError, not a
  device over its budget. close() lifts the cap.
"""

from __future__ import annotations

import warnings

import torch

from ... import allocator
from ..._env import logger
from ..._units import format_bytes
from . import budget
from .blocks import Blocks, find_blocks, require_blocks
from .calls import CheckpointCalls, verify_mechanism
from .host_buffers import HostBuffers
from .offload import ActivationOffload
from .planner import ActivationPlanner

class ActivationManager:
    """Built by enable() where the config asks for checkpointing or offload (see the note above)."""

    def __init__(self, model, config, device, placement, ranks_on_host: int, cap_torch: bool, lower_budget=None,
                 chunk_floor_bytes: int = 0):
        """`placement`: (chunks, placer, tracer), what the plan's room is read from; `cap_torch`: whether
        torch's allocator is capped at what the chunks leave (cuda, default allocator); `lower_budget(bytes)`
        lowers the chunks' budget in the first iteration (placer.lower_budget_in_warm_up)."""
        checkpointing, offload = config.activation_checkpointing, config.activation_offload
        found = find_blocks(model)
        if checkpointing != "off" or offload == "auto":
            found = require_blocks(model, f"activation_checkpointing={checkpointing!r}" if checkpointing != "off"
                                   else "activation_offload='auto'")
        self._device, self._mode = device, (checkpointing, offload)
        self.offload = None
        if offload != "off":
            verify_mechanism()  # see [Note: the mechanism check] (calls.py)
            self.offload = ActivationOffload(HostBuffers(device.context, ranks_on_host), device.torch_device)
        default = "offload" if offload != "off" else "recompute"
        self.blocks = Blocks(found, self.offload, default, wrap_forward=checkpointing != "off")
        self._last_block = found[1][-1] if found is not None else None
        self._last_block_hook, self._after_blocks_bytes = None, None  # the first forward's, see _foresee_the_loss
        self.calls = CheckpointCalls(model, self.blocks.route)
        self.calls.wrap()
        self.planner = None
        if "auto" in (checkpointing, offload):
            chunks, placer, tracer = placement
            self.planner = ActivationPlanner(self.blocks, device, chunks, placer, tracer, checkpointing, offload,
                                             host_buffers=self.offload._buffers if self.offload else None)
        self._cap_torch = cap_torch and device.is_cuda and self.planner is not None  # the cap reads the plan's chunks
        self.torch_cap_bytes = None
        self._lower_budget = lower_budget
        self._chunk_floor = chunk_floor_bytes  # the least device bytes the chunks may have (three of the largest sets)
        self.warm_up = None  # what the first block's measurement set: {"foreseen_bytes", "chunk_budget_bytes"}
        if self.planner is not None and self._cap_torch:
            self.planner.probe.on_first_block = self._first_block_measured
        self._warned: set = set()
        self._outside_bytes = 0  # the device's memory outside torch, last measured (allocator.outside_torch_bytes)
        self._handles = [model.register_forward_pre_hook(self._forward_started),
                         model.register_forward_hook(self._forward_ended, always_call=True)]
        self._calls_at_start = 0

    def _forward_started(self, module, args):  # see [Note: the root forward]
        self.calls.wrap()  # see [Note: the checkpoint functions a model carries] (calls.py)
        if self.planner is not None and self.planner.refusal is not None:
            raise RuntimeError(self.planner.refusal)
        if self.offload is not None:
            self._calls_at_start = self.offload.counts["calls"]
            self.offload.enter()

    def _forward_ended(self, module, args, output):
        if self.offload is not None:
            self.offload.leave()
            if self._mode == ("off", "on") and torch.is_grad_enabled() and module.training \
                    and self.offload.counts["calls"] == self._calls_at_start:
                self._warn_once("no calls", "gemini_ext: activation_offload='on', but this forward made no "
                                "checkpoint call the engine takes part in, so nothing went to the host. The engine "
                                "offloads the inputs of its own block checkpointing (activation_checkpointing='on' or "
                                "'auto') and of the checkpoint function a model carries (transformers' "
                                "gradient_checkpointing_enable()); a torch.utils.checkpoint call in the model's own "
                                "code is not seen.")
        if self.warm_up is not None and "loss" not in self.warm_up and torch.is_grad_enabled() and module.training:
            self._foresee_the_loss(output)

    def backward_started(self) -> None:
        if self.offload is not None:
            self.offload.backward_started()

    def after_iteration(self) -> None:
        if self.planner is not None:
            decided = self.planner.plan is not None
            self.planner.after_iteration()
            if not decided and self.planner.plan is not None:
                logger.info("activations: plan %s; offload %s", self.planner.stats(),
                            self.offload.stats() if self.offload is not None else None)
            if self._mode == ("off", "auto") and self.planner.plan is None and not self.planner.probe.ran:
                self._warn_once("nothing planned", "gemini_ext: activation_offload='auto' with "
                                "activation_checkpointing='off' plans the blocks the model checkpoints itself, and "
                                "this iteration checkpointed none. Enable the model's checkpointing (transformers: "
                                "gradient_checkpointing=True) or set activation_checkpointing='auto'.")
        if self._cap_torch and (self.planner is None or self.planner.refusal is None):
            self._outside_bytes = self.planner.outside_torch_bytes()  # as the tracer measured this iteration
            self._apply_torch_cap()

    def _first_block_measured(self, activation_bytes: int, input_bytes: int) -> None:  # see [Note: the root forward]
        held = torch.cuda.memory_reserved(self._device.torch_device)
        capacity, total = self._device.capacity_bytes(), self._device.total_bytes()
        outside = self._outside_bytes = allocator.outside_torch_bytes(self._device.torch_device,
                                                                      whole_device=capacity >= total)
        floor = self._chunk_floor
        foreseen, need, refused = budget.warm_up_need(self.planner.warm_device_bytes(activation_bytes, input_bytes),
                                                      held, outside, capacity, total, floor)
        self.warm_up = {"block0_activation_bytes": activation_bytes, "block0_input_bytes": input_bytes,
                        "foreseen_bytes": foreseen, "torch_reserved_bytes": held, "outside_torch_bytes": outside,
                        "chunk_floor_bytes": floor}
        logger.info("activations: the first forward foresees %s (block 0: %s of activations, %s of input), torch "
                    "holds %s", format_bytes(foreseen), format_bytes(activation_bytes), format_bytes(input_bytes),
                    format_bytes(held))
        if refused:
            raise RuntimeError(self.planner.warm_up_refusal(need, capacity - floor))
        lowered = self._lower_budget(need) if self._lower_budget else None
        self.warm_up["chunk_budget_bytes"] = lowered
        self._apply_torch_cap()
        if self._last_block is not None:  # what the forward allocates after its blocks: see _foresee_the_loss
            self._last_block_hook = self._last_block.register_forward_hook(self._last_block_ended)

    def _last_block_ended(self, module, args, output) -> None:
        self._after_blocks_bytes = torch.cuda.memory_allocated(self._device.torch_device)

    def _foresee_the_loss(self, output) -> None:  # see [Note: the root forward]
        if self._last_block_hook is not None:
            self._last_block_hook.remove()
            self._last_block_hook = None
        dev = self._device.torch_device
        head = torch.cuda.memory_allocated(dev) - self._after_blocks_bytes if self._after_blocks_bytes else 0
        elements, loss_in_output = _largest_floating_output(output)
        foreseen = budget.foreseen_loss_bytes(max(0, head), elements, loss_in_output)
        held = torch.cuda.memory_reserved(dev)
        self.warm_up["loss"] = {"head_bytes": head, "largest_output_elements": elements,
                                "loss_in_output": loss_in_output, "foreseen_bytes": foreseen,
                                "torch_reserved_bytes": held}
        if self.torch_cap_bytes is None or held + foreseen <= self.torch_cap_bytes:
            return
        need = held + self._outside_bytes + foreseen
        capacity = self._device.capacity_bytes()
        if budget.warm_up_refused(need, capacity, self._device.total_bytes(), self._chunk_floor):
            free_bytes, b = capacity - self._chunk_floor, format_bytes
            raise RuntimeError(
                f"gemini_ext: the first forward's largest output ({elements:,} elements) foresees {b(foreseen)} for "
                f"the loss's backward beside the {b(held)} torch holds and the {b(self._outside_bytes)} outside torch, "
                f"{b(need - free_bytes)} more than the {b(free_bytes)} the device budget ({b(capacity)}) leaves beside "
                f"three chunk sets. The engine keeps the budget rather than run over it: compute the loss over "
                f"fewer tokens at a time (a smaller batch, or the LM head and loss in pieces), or raise "
                f"gpu_memory_limit by at least "
                f"{b(need - free_bytes)}.")
        logger.info("activations: the loss's backward over the output foresees %s beside the %s torch holds: "
                    "the chunks' budget is lowered", format_bytes(foreseen), format_bytes(held))
        self.warm_up["chunk_budget_bytes"] = self._lower_budget(need) if self._lower_budget else None
        self._apply_torch_cap()

    def _apply_torch_cap(self) -> None:
        total, capacity = self._device.total_bytes(), self._device.capacity_bytes()
        if capacity >= total:
            return  # the whole device: torch meets the chunks at the device's own end
        self.torch_cap_bytes = max(0, capacity - self.planner.chunk_need_bytes() - self._outside_bytes)
        torch.cuda.set_per_process_memory_fraction(self.torch_cap_bytes / total, self._device.torch_device)

    def widen_torch_cap(self, extra_bytes: int) -> None:
        """Raises torch's cap by `extra_bytes` the chunks gave up (a generation's KV cache,
        see [Note: room for the KV cache]); restore_torch_cap() sets it back."""
        if self.torch_cap_bytes is not None:
            total = self._device.total_bytes()
            torch.cuda.set_per_process_memory_fraction(min(1.0, (self.torch_cap_bytes + extra_bytes) / total),
                                                       self._device.torch_device)

    def restore_torch_cap(self) -> None:
        if self.torch_cap_bytes is not None:
            self._apply_torch_cap()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._last_block_hook is not None:
            self._last_block_hook.remove()
            self._last_block_hook = None
        self._lower_budget = None  # the manager and its chunks go with the engine (close())
        if self.planner is not None:
            self.planner.detach()
        self.calls.unwrap()
        self.blocks.remove()
        if self.offload is not None:
            self.offload.remove()
        if self.torch_cap_bytes is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, self._device.torch_device)
            self.torch_cap_bytes = None

    def stats(self) -> dict:
        return {"checkpointing": self.blocks.stats(),
                "offload": self.offload.stats() if self.offload is not None else None,
                "plan": self.planner.stats() if self.planner is not None else None,
                "torch_cap_bytes": self.torch_cap_bytes, "warm_up": self.warm_up}


def _largest_floating_output(output, depth: int = 3) -> tuple[int, bool]:
    """The element count of the largest floating tensor in a forward's output (a tensor, or one inside
    a tuple, list or mapping such as transformers' ModelOutput), and whether it holds a loss (a
    floating scalar that requires grad)."""
    if isinstance(output, torch.Tensor):
        floating = output.is_floating_point()
        return (output.numel() if floating else 0), floating and output.dim() == 0 and output.requires_grad
    if depth == 0:
        return 0, False
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    largest, loss = 0, False
    for item in items:
        n, has_loss = _largest_floating_output(item, depth - 1)
        largest, loss = max(largest, n), loss or has_loss
    return largest, loss
