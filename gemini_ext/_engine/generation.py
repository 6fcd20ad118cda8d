"""GenerationBudget: the device room a generation's KV cache needs, taken from the chunks for the
length of `engine.generating()`, and given back after it.

[Note: room for the KV cache]
- During training the chunks' device budget is the placement's; what torch allocates beside the
  chunks (activations) was measured in the first iteration and left free. A generation allocates
  something training never did: the KV cache, growing by one token per layer per step. Left
  unaccounted it would take the device from under the chunks' budget (past gpu_memory_limit).
- `engine.generating(kv_cache_bytes=...)` (or batch_size and max_length, from which the model's
  config gives the bytes: keys and values for every layer, every key-value head) lowers the chunks'
  budget by that much for the block; parameter chunks beyond the lowered budget are evicted to
  their host copies and stream back with prefetch as each forward reaches them, and those that fit
  stay resident for the whole generation. Where they do not all fit, the sets in order stay while
  they fit beside two chunks of streaming room, and the others (stepped on the host, so with a host
  copy) go back to it after each use, as host-home chunks do in training: the budget keeps free
  room, and prefetch fetches the next chunks while the current ones compute.
- The optimizer side (gradients, masters, moments) of a chunk set kept on the device computes
  nothing while generating. Where the parameter chunks and the optimizer sides on the device do not
  both fit the lowered budget, sets' optimizer sides move to the host, the last sets first, until
  they do or none is left; they come back when the block ends. The bytes are the same: training
  after the block is bit-identical.
- A budget that, less the KV cache, cannot hold the three chunk sets a forward computes with and
  prefetches (the same floor as the first iteration's warm-up) is refused before anything moves,
  naming the figures and the fixes.
- Each forward pass inside the block is an iteration of an access trace of its own (the manager
  sets training's aside and takes it back at the end): from the second pass on, prefetch and
  eviction follow one pass's order, where training's trace would have them expect the backward.
- Where torch's allocator is capped at what the chunks leave (activations planned under a
  limit), the cap rises by the room for the block and is set again after it.

[Note: a generation with every parameter resident]
A decode step of a large model is a few milliseconds of device work, launched by Python; hooks on
every module (two calls into the manager each, and torch's slower module call path for a module
with hooks) cost more than the model's own launches. So where no set streams, the first forward
of the block (the prompt's) runs with the hooks, which bring every parameter chunk to the device,
and at the next forward's start the manager holds them there (no eviction chooses one: a
growing KV cache that reclaims device memory takes other chunks) and the hooks come off every
module but the root: the model then computes as it would alone, its parameters bound to the
held chunks. The root's hooks stay and check (states offloaded, writes between forwards, the
trace). A forward with gradients enabled inside the block puts the hooks back first (its
backward needs them); the block's end does too, and lets the chunks go. Where a parameter chunk
is not on the device at that point (a set whose home is the host: it went back after its use)
nothing is held and the hooks stay.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from .._native import _C
from .._units import format_bytes
from ..placement import host_memory
from ..placement.chunk_floor import CHUNK_SETS_AT_ONCE, chunk_floor_bytes
from ..placement.costs import layout_figures


def kv_cache_bytes(config, batch_size: int, max_length: int, itemsize: int) -> int:
    """Bytes of a transformers decoder's KV cache holding `max_length` tokens of `batch_size`
    sequences: keys and values for every layer and key-value head, `itemsize` bytes each."""
    need = ("num_hidden_layers", "num_attention_heads", "hidden_size")
    missing = [f for f in need if not isinstance(getattr(config, f, None), int)]
    if missing:
        raise ValueError(f"engine.generating(batch_size=..., max_length=...): the model's config lacks {missing}, "
                         "which size the KV cache; pass kv_cache_bytes= instead (the bytes the cache will take).")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * batch_size * max_length * itemsize


class GenerationBudget:
    """Lowers the chunks' device budget for a generation (see [Note: room for the KV cache])."""

    def __init__(self, runtime, layout, phases, activations, hooks, ranks_on_host: int):
        self._runtime, self._layout, self._phases, self._activations = runtime, layout, phases, activations
        self._hooks, self._ranks_on_host = hooks, ranks_on_host
        self.active = None  # (optimizer sides moved to the host, the budget before) inside the block
        self._passes = 0  # forwards inside the block so far
        self._may_hold = False  # no set streams: the parameters may be held resident

    def detach(self) -> None:
        """Lets go of the manager (the engine closes)."""
        self._runtime = self._activations = None

    def forward_starts(self) -> None:
        """The model's forward starts: inside the block, the last pass's trace is closed, and the
        module hooks come off or go back (see [Note: a generation with every parameter resident])."""
        if self.active is None:
            return
        hold = self._may_hold and self._passes > 0 and not torch.is_grad_enabled()
        if self._hooks.module_hooks_off and not hold:
            self._let_go()
        if not self._hooks.module_hooks_off:
            self._runtime.end_generation_pass()
            if hold and self._runtime.hold_params_on_device():
                self._hooks.set_module_hooks_off(True)
        self._passes += 1

    def _let_go(self) -> None:
        self._hooks.set_module_hooks_off(False)
        self._runtime.release_params_on_device()

    def check_outside(self, what: str) -> None:
        if self.active is not None:
            raise RuntimeError(f"{what}: inside engine.generating(), where sets' optimizer state may have moved to "
                               "the host for the KV cache's room; step after the block ends.")

    @contextlib.contextmanager
    def held(self, kv_cache_bytes: int):
        self._phases.check_resident("engine.generating()")
        if self.active is not None:
            raise RuntimeError("engine.generating(): already inside a generating() block; one block holds one "
                               "KV cache's room (pass the largest batch_size and max_length it generates).")
        moved, streamed, before = self._enter(kv_cache_bytes)
        self.active = (moved, before)
        self._passes, self._may_hold = 0, not streamed
        self._runtime.begin_generation_trace()
        try:
            yield {"kv_cache_bytes": kv_cache_bytes, "chunk_budget_bytes": self._runtime.device_budget,
                   "optimizer_sets_moved": len(moved), "parameter_sets_streamed": len(streamed)}
        finally:
            self.active = None
            if self._runtime is not None:  # else the engine closed inside the block: nothing is left to restore
                self._leave(moved, streamed, before)

    def _leave(self, moved: list, streamed: list, before: int) -> None:
        if self._hooks.module_hooks_off:
            self._let_go()
        self._runtime.end_generation_trace()
        for k in streamed:
            self._runtime.set_param_home_on_host(k, False)
        self._runtime.set_device_budget(before)
        for k in moved:
            self._runtime.set_optim_on_host(k, False)
        if self._activations is not None:
            self._activations.restore_torch_cap()

    def _enter(self, kv_cache_bytes: int) -> tuple:
        if kv_cache_bytes < 0:
            raise ValueError(f"engine.generating(): kv_cache_bytes must be at least 0, got {kv_cache_bytes}.")
        self._runtime.synchronize()  # host steps still running finish before their sets move
        before = self._runtime.device_budget
        figures = layout_figures(self._layout)
        shard_bytes = figures["set_shard_bytes"]
        floor = chunk_floor_bytes(shard_bytes)
        left = before - kv_cache_bytes
        if left < floor:
            raise _C.OutOfMemoryError(
                f"engine.generating(): the chunks' device budget is {format_bytes(before)}; less the "
                f"{format_bytes(kv_cache_bytes)} kept for the KV cache it leaves {format_bytes(max(0, left))}, under "
                f"the "
                f"{format_bytes(floor)} the largest {CHUNK_SETS_AT_ONCE} chunk sets a forward computes with and "
                "prefetches need. Generate fewer or shorter sequences at a time (batch_size, max_length), raise "
                "gpu_memory_limit, or use smaller chunks (chunk_config_dict / min_chunk_size_m).")
        moved, held = self._move_optimizer_sides(left, shard_bytes, figures)
        streamed = self._stream_beyond(left - held, shard_bytes)
        if streamed:
            short = sum(shard_bytes) - (left - held)
            smaller = (f"a KV cache of at most {format_bytes(kv_cache_bytes - short)} (fewer or shorter sequences), or "
                       if kv_cache_bytes > short else "")
            warnings.warn(
                f"engine.generating(): the parameter chunks ({format_bytes(sum(shard_bytes))}) do not fit beside the "
                f"{format_bytes(kv_cache_bytes)} KV cache in the chunks' budget ({format_bytes(before)}, of which "
                f"{format_bytes(held)} stay the optimizer's): {len(streamed)} chunk sets stream from the host on every "
                f"forward, at the link's pace. To keep them resident: {smaller}a budget "
                f"{format_bytes(short)} larger (gpu_memory_limit).", stacklevel=6)  # the caller's with line
        self._runtime.set_device_budget(left)  # parameter chunks beyond it go to their host copies
        if self._activations is not None:
            self._activations.widen_torch_cap(kv_cache_bytes)
        return moved, streamed, before

    def _stream_beyond(self, param_free_bytes: int, shard_bytes) -> list:
        """Where the parameter chunks do not all fit `param_free_bytes`: the sets in order stay resident
        while they fit beside two chunks of streaming room, and the rest (those with a host copy:
        stepped on the host) go back to it after each use, so that prefetch has room for the next."""
        if sum(shard_bytes) <= param_free_bytes:
            return []
        keep = param_free_bytes - 2 * max(shard_bytes, default=0)
        streamed = []
        for k, place in enumerate(self._runtime.set_placements()):
            keep -= shard_bytes[k]
            if keep >= 0 or place["param_home_on_host"] or not (place["trainable"] and place["optim_on_host"]):
                continue
            self._runtime.set_param_home_on_host(k, True)
            streamed.append(k)
        return streamed

    def _move_optimizer_sides(self, left: int, shard_bytes, figures) -> list:
        """The last sets' optimizer sides to the host until the parameter chunks and the optimizer
        sides still on the device fit `left` (or none is left on the device)."""
        per_element, itemsize = figures["set_bytes_per_element"], figures["compute_itemsize"]
        on_device = [k for k, place in enumerate(self._runtime.set_placements())
                     if place["trainable"] and not place["optim_on_host"]]
        optimizer_bytes = {k: shard_bytes[k] // itemsize * per_element for k in on_device}
        params = sum(shard_bytes)
        held = sum(optimizer_bytes.values())
        moved = []
        for k in reversed(on_device):
            if params + held <= left:
                break
            moved.append(k)
            held -= optimizer_bytes[k]
        leaving = sum(optimizer_bytes[k] for k in moved)
        free_bytes = host_memory.host_available_bytes(self._ranks_on_host)
        if free_bytes is not None and leaving > free_bytes:
            raise MemoryError(f"engine.generating(): {format_bytes(leaving)} of optimizer state would move to the "
                              f"host to make the KV cache's room, which has {format_bytes(free_bytes)} available for "
                              f"it. "
                              "Free host memory, or generate fewer or shorter sequences at a time.")
        for k in moved:
            self._runtime.set_optim_on_host(k, True)
        return moved, held
