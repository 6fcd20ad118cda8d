"""Blocks: the model's repeated blocks, and how each block's call runs: activations kept, recomputed
from its input (non-reentrant checkpointing), or recomputed with the input offloaded
(`GeminiConfig(activation_checkpointing=...)`, and per block where the plan decides).

[Note: which blocks, and how]
- The blocks are the children of the model's largest `nn.ModuleList` (by parameters) whose
  children are all of one class, at least two of them: transformers' decoder layers, the
  project's GPT blocks. The engine's checkpointing ("on"/"auto") refuses a model without one.
- The engine's checkpointing replaces each block's `forward` on the instance by one that runs the
  original under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` while grad is
  enabled; hooks, parameter names and state-dict keys stay as they were, and close() deletes the
  instance attribute, leaving the class's forward.
- A model that checkpoints itself (transformers' gradient checkpointing, the project's
  `Checkpointed` blocks) keeps its own checkpoint: its calls come through the function the model
  carries (calls.py) to `route`, which runs them as the plan says (keep: the block's forward
  without the checkpoint, only where the engine decides the checkpointing), and `stats()` counts
  them as left to the model. Its blocks are planned like the engine's.
- Only a planned call's inputs go to the host (offload.taking): other checkpoints (a loss computed
  in pieces, needed first in backward) keep theirs.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint

ENGINE_CHECKPOINT = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


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


def require_blocks(model: torch.nn.Module, field: str = "activation_checkpointing='on'") -> tuple:
    """find_blocks(model), or ValueError saying why the engine cannot plan this model's blocks."""
    found = find_blocks(model)
    if found is None:
        raise ValueError(
            f"{field}: the model has no nn.ModuleList of two or more blocks of one class "
            f"({type(model).__name__}), so the engine cannot tell which modules to checkpoint. Checkpoint the "
            "model's own blocks (torch.utils.checkpoint.checkpoint(..., use_reentrant=False)) and leave "
            "activation_checkpointing='off'.")
    return found


def _checkpoints_itself(block: torch.nn.Module) -> bool:
    return getattr(block, "gradient_checkpointing", False) is True and block.training


class Blocks:
    """Runs each block's call as `choices` say (set by the planner under "auto"): "keep" (no
    checkpoint), "recompute" or "offload" (recompute, the input offloaded). None: `default`. A
    `probe` set by the planner runs the blocks of the forward it measures."""

    def __init__(self, found, offload, default: str, wrap_forward: bool):
        self.blocks_name, blocks = found if found is not None else (None, [])
        self.num_blocks = len(blocks)
        self._index = {id(block): i for i, block in enumerate(blocks)}
        self._offload = offload  # None without offload: "offload" runs as "recompute"
        self.default = default
        self.choices: list | None = None
        self.probe = None
        self._wrapped: list = []
        self.counts = {"blocks": self.num_blocks, "checkpointed_calls": 0, "kept_calls": 0,
                       "calls_left_to_the_model": 0}
        if wrap_forward:
            for index, block in enumerate(blocks):
                wrapper = functools.partial(self._engine_call, index, block, block.forward)
                block.forward = wrapper
                self._wrapped.append((block, wrapper))

    def _engine_call(self, index, block, original, *args, **kwargs):  # see [Note: which blocks, and how]
        if not torch.is_grad_enabled() or _checkpoints_itself(block):  # the model's own call comes to route()
            return original(*args, **kwargs)
        return self.run(index, ENGINE_CHECKPOINT, original, args, kwargs)

    def route(self, module, checkpoint_fn, fn, args, kwargs):
        """A checkpoint call the model makes through the function it carries
        (see [Note: the checkpoint functions a model carries], calls.py)."""
        if not torch.is_grad_enabled():
            return checkpoint_fn(fn, *args, **kwargs)
        self.counts["calls_left_to_the_model"] += 1
        return self.run(self._index.get(id(module)), checkpoint_fn, fn, args, kwargs)

    def run(self, index, checkpoint_fn, fn, args, kwargs):
        if self.probe is not None and index is not None:
            return self.probe.run(index, self, checkpoint_fn, fn, args, kwargs)
        choice = self.choices[index] if self.choices is not None and index is not None else self.default
        return self.execute(choice, checkpoint_fn, fn, args, kwargs)

    def execute(self, choice: str, checkpoint_fn, fn, args, kwargs):
        # see [Note: what is offloaded, and how it is found] (offload.py)
        if choice == "keep":
            self.counts["kept_calls"] += 1
            return fn(*args, **kwargs)
        if checkpoint_fn is ENGINE_CHECKPOINT:
            self.counts["checkpointed_calls"] += 1
        if choice == "offload" and self._offload is not None:
            with self._offload.taking(args):
                return checkpoint_fn(fn, *args, **kwargs)
        return checkpoint_fn(fn, *args, **kwargs)

    def remove(self) -> None:
        for block, wrapper in self._wrapped:
            if block.__dict__.get("forward") is wrapper:
                del block.__dict__["forward"]
        self._wrapped.clear()

    def stats(self) -> dict:
        return {"module": self.blocks_name, **self.counts}
