"""BlockProbe: measures the blocks in the first forward with grad, for the plan (planner.py).

[Note: what is measured]
- Every block runs with the least device memory the plan may choose (its input offloaded where
  offload may be on, else recomputed), so the first iteration needs no more than any plan will.
- Per block: its input bytes (its tensor arguments) and its forward time (CUDA events on cuda, the
  host clock on sim). Blocks repeat, so block i's activations are taken as block 0's scaled by
  their inputs, and its backward as twice its forward.
- Block 0's activations are counted by a forward of block 0 of its own, before its real call,
  under saved-tensor hooks that count what it saves (per storage, parameters and their views left
  out),
  with the random state forked so the real call draws the same numbers; its output is dropped at
  once, so those activations live only as long as a recompute's would. The real call then runs
  checkpointed like the others.
- That forward gets its own copies of the arguments that are neither tensors nor plain values: a
  block may change an object it is given (transformers' decoder layers append their keys and
  values to the KV cache when the model is left at `use_cache=True`), and the real call must find
  it as the model left it. Tensors inside such an object stay shared: only the object is new.
"""

from __future__ import annotations

import copy
import time

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..._native import _C

BACKWARD_PER_FORWARD = 2.0


class BlockProbe:
    """Runs the blocks of the measured forward (Blocks.run while `probe` is set)."""

    def __init__(self, num_blocks: int, device: torch.device, warm_choice: str):
        self._device = device
        self._cuda = device.type == "cuda"
        self.warm_choice = warm_choice
        self.input_bytes = [0] * num_blocks
        self._marks: list = [None] * num_blocks
        self.block0_activation_bytes = 0
        self.tokens = 0  # block 0's first input, its elements over its last dimension
        self.ran = False
        self.on_first_block = None  # called with (activation_bytes, input_bytes) once block 0 is measured

    def run(self, index, blocks, checkpoint_fn, fn, args, kwargs):
        self.ran = True
        tensors = [t for t in args if isinstance(t, torch.Tensor) and t.is_floating_point()]
        self.input_bytes[index] = sum(t.numel() * t.element_size() for t in tensors)
        if index == 0:
            self.block0_activation_bytes = self._count_activations(fn, args, kwargs)
            if tensors and tensors[0].dim() > 0 and tensors[0].shape[-1] > 0:
                self.tokens = tensors[0].numel() // tensors[0].shape[-1]
            if self.on_first_block is not None:
                self.on_first_block(self.block0_activation_bytes, self.input_bytes[0])
        start = self._mark()
        out = blocks.execute(self.warm_choice, checkpoint_fn, fn, args, kwargs)
        self._marks[index] = (start, self._mark())
        return out

    def _count_activations(self, fn, args, kwargs) -> int:
        """The bytes block 0 saves for backward. The saves are held beside the graph, not in it, and
        the graph is never run backward: a pack hook that returned a saved output itself would tie
        that output to its own node in a cycle the garbage collector cannot see, keeping the whole
        graph (and the engine) alive."""
        seen: dict = {}
        held: list = []
        devices = [self._device.index or 0] if self._cuda else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: _count(seen, held, t), _never_unpacked):
            own_args, own_kwargs = _own_copies(args, kwargs)
            out = fn(*own_args, **own_kwargs)
        del out, own_args, own_kwargs
        held.clear()
        return sum(seen.values())

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

    def measured_blocks(self) -> int:
        return sum(mark is not None for mark in self._marks)

    def blocks(self) -> list[tuple]:
        """(activation_bytes, input_bytes, forward_seconds, backward_seconds) per block."""
        first = self.input_bytes[0]
        out = []
        for inputs, forward in zip(self.input_bytes, self.forward_seconds()):
            activations = self.block0_activation_bytes * inputs // first if first else self.block0_activation_bytes
            out.append((int(activations), int(inputs), forward, BACKWARD_PER_FORWARD * forward))
        return out


_PLAIN = (torch.Tensor, int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device)


def _own_copies(args, kwargs):
    """(args, kwargs) with every argument that is neither a tensor nor a plain value deep-copied,
    the tensors it refers to shared (see [Note: what is measured])."""
    leaves, spec = tree_flatten((args, kwargs))
    if all(isinstance(leaf, _PLAIN) for leaf in leaves):
        return args, kwargs
    memo: dict = {}
    for leaf in leaves:
        _share_tensors(leaf, memo, set(), depth=8)
    return tree_unflatten([leaf if isinstance(leaf, _PLAIN) else _copy_or_share(leaf, memo) for leaf in leaves], spec)


def _copy_or_share(obj, memo: dict):
    try:
        return copy.deepcopy(obj, memo)
    except Exception:  # not copyable (a handle, a generator): the measuring forward gets it as it is
        return obj


def _share_tensors(obj, memo: dict, visited: set, depth: int) -> None:
    """Enters every tensor reachable from `obj` (containers and attributes, `depth` levels down) in
    deepcopy's memo as itself, so that a copy of `obj` refers to the same tensors."""
    if isinstance(obj, torch.Tensor):
        memo[id(obj)] = obj
        return
    if depth == 0 or isinstance(obj, _PLAIN) or id(obj) in visited:
        return
    visited.add(id(obj))
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    else:
        children = list(getattr(obj, "__dict__", {}).values())
        for name in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, name):
                children.append(getattr(obj, name))
    for child in children:
        _share_tensors(child, memo, visited, depth - 1)


def _count(seen: dict, held: list, tensor: torch.Tensor) -> None:
    """Notes the bytes `tensor` holds: per storage, the largest tensor saved over it (held until the
    forward ends, so that no storage is freed and its address reused while counting). Parameters
    (trainable or frozen) and their views live in chunks and are left out."""
    if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter) or \
            (tensor.is_leaf and tensor.requires_grad):
        return None
    held.append(tensor)
    storage = tensor.untyped_storage()
    nbytes = min(storage.nbytes(), tensor.numel() * tensor.element_size())
    seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), nbytes)
    return None


def _never_unpacked(packed):
    raise _C.InternalError("gemini_ext internal error (this is a bug, please report it): the forward that measures "
                       "block 0's activations was run backward.")
