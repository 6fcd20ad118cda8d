"""BlockCheckpointing: the engine runs a model's repeated blocks under non-reentrant activation
checkpointing itself (`GeminiConfig(activation_checkpointing="on"` or `"auto"`).

[Note: which blocks, and how]
- The blocks are the children of the model's largest `nn.ModuleList` (by parameters) whose
  children are all of one class, at least two of them: transformers' decoder layers, the
  project's GPT blocks. A model without one is refused with the reason.
- Each block's `forward` is replaced on the instance by one that calls the original under
  `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` while grad is enabled; hooks,
  parameter names and state-dict keys stay as they were, and close() deletes the instance
  attribute, leaving the class's forward.
- A model that checkpoints itself is left to do so: blocks whose `gradient_checkpointing` flag is
  set (transformers, checked at every call, so a flag set after enable() counts) and the
  project's `Checkpointed` blocks run their forward as it is, and `stats()` says so.
- With activation offload, only the blocks' inputs go to the host: the offload accepts a
  checkpoint's inputs only while a block runs (one the plan offloads, or one that checkpoints
  itself), so other checkpoints (a loss computed in pieces, needed first in backward) keep theirs.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint


def find_blocks(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """(name, ModuleList) of the model's repeated blocks, or None."""
    best, best_params = None, 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        params = sum(p.numel() for p in module.parameters())
        if params > best_params:
            best, best_params = (name, module), params
    return best


def _checkpoints_itself(block: torch.nn.Module) -> bool:
    if getattr(block, "gradient_checkpointing", False) is True:
        return True
    return type(block).__name__ == "Checkpointed" and type(block).__module__.startswith("gemini_ext.")


def require_blocks(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """find_blocks(model), or ValueError saying why the engine cannot checkpoint this model."""
    found = find_blocks(model)
    if found is None:
        raise ValueError(
            "activation_checkpointing='on': the model has no nn.ModuleList of two or more blocks of one class "
            f"({type(model).__name__}), so the engine cannot tell which modules to checkpoint. Checkpoint the "
            "model's own blocks (torch.utils.checkpoint.checkpoint(..., use_reentrant=False)) and leave "
            "activation_checkpointing='off'.")
    return found


class BlockCheckpointing:
    """Wraps the blocks' forward; `remove()` unwraps them. `choices` (set by the planner under
    "auto": activation_planner.py) says per block "keep" (no checkpoint), "recompute" or
    "offload" (recompute, the input offloaded); None checkpoints every block and offloads where
    offload is on. A `probe` set by the planner runs the blocks of the forward it measures."""

    def __init__(self, model: torch.nn.Module, offload=None):
        self.blocks_name, blocks = require_blocks(model)
        self.num_blocks = len(blocks)
        self._offload = offload  # told per call whether a block's input may go to the host
        if offload is not None:  # the engine knows the blocks: other checkpoints' inputs (a loss in pieces) stay
            offload.accepting = False
        self.choices: list | None = None
        self.probe = None
        self._wrapped: list = []
        self.counts = {"blocks": len(blocks), "checkpointed_calls": 0, "kept_calls": 0, "calls_left_to_the_model": 0}
        for index, block in enumerate(blocks):
            original = block.forward
            wrapper = functools.partial(self._run, index, block, original)
            block.forward = wrapper
            self._wrapped.append((block, wrapper))

    def _run(self, index, block, original, *args, **kwargs):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if _checkpoints_itself(block):
            self.counts["calls_left_to_the_model"] += 1
            return self._with_offload(True, original, args, kwargs)
        if self.probe is not None:
            return self.probe.run(index, original, args, kwargs, self)
        choice = self.choices[index] if self.choices is not None else "offload"
        if choice == "keep":
            return self.kept(original, args, kwargs)
        return self.checkpointed(original, args, kwargs, offload=choice == "offload")

    def kept(self, original, args, kwargs):
        self.counts["kept_calls"] += 1
        return original(*args, **kwargs)

    def checkpointed(self, original, args, kwargs, offload: bool):
        self.counts["checkpointed_calls"] += 1
        return self._with_offload(offload, torch.utils.checkpoint.checkpoint, (original, *args),
                                  {"use_reentrant": False, **kwargs})

    def _with_offload(self, offload: bool, fn, args, kwargs):
        if self._offload is None:
            return fn(*args, **kwargs)
        self._offload.accepting = offload
        try:
            return fn(*args, **kwargs)
        finally:
            self._offload.accepting = False

    def remove(self) -> None:
        if self._offload is not None:
            self._offload.accepting = True
        for block, wrapper in self._wrapped:
            if block.__dict__.get("forward") is wrapper:
                del block.__dict__["forward"]
        self._wrapped.clear()

    def stats(self) -> dict:
        return {"module": self.blocks_name, **self.counts}
