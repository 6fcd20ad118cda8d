"""Filling the chunks from the model's tensors: a transaction that releases the originals as it
goes and gives them back if enable() fails.

[Note: releasing the model's own tensors while filling the chunks]
A model that fills most of host memory cannot coexist with a second full copy of itself in
chunks. Unsharded, every parameter's exact value lands in a chunk of this process (the fp32
master, or the parameter chunk itself under fp32), so the original tensor is released right
after it is copied. If enable() fails later, `rollback()` reads the values back from those
chunks so the caller's model is intact. Sharded, each rank keeps only its shard, and every rank
holds a whole model to begin with (a 20B model in fp32 is 81 GB per GPU): the originals are
released too, but a failure cannot give them back without the other ranks (a collective a
failed rank may never join), so the error says that the model must be built again instead. A
parameter enable() materialised from meta holds the initialiser's values only: it is released
whether or not a chunk holds it exactly (an fp32 one under the 8-byte state has only its bf16
rounding in a chunk), and a failure puts it back on the meta device.
"""

from __future__ import annotations

import time

import torch

from .._native import _C
from ..placement.costs import TIERS
from .layout import held_exactly


def allocated_on_write(layout, device_first: list, compute_device) -> set:
    """The device-first chunks that get their device copy only as the fill reaches them: all of
    them (but the optimizer state, which gets memory when an optimizer attaches) where the
    model's own tensors occupy the compute device, built there or materialised there from meta,
    so that the memory those tensors give back serves the chunks."""
    if not any(device == compute_device for _, device in layout.orig):
        return set()
    return set(device_first) - set(layout.unbound_state_chunks())


class ChunkFill:
    """Writes every parameter's value into its chunks (this rank's shard of it), releasing the
    originals (see the note above)."""

    def __init__(self, layout, chunks, groups, device, meta):
        self._layout = layout
        self._chunks = chunks
        self._groups = groups
        self._device = device  # ComputeDevice
        self._meta = meta      # MetaMaterializer (empty unless the model was built on meta)
        self._released = []    # (parameter index, (chunk, slot), shape): values held exactly by a chunk
        self._released_meta = []  # (parameter index, shape): materialised from meta, not held exactly
        self.released_sharded = 0
        # The fill phase in parts (stats()["setup_fill_seconds"]): materialising meta-built
        # modules, taking rank 0's values, writing the shards. The device is synchronised at each
        # part's end, so that asynchronous kernels are counted where they were launched.
        self.parts = dict.fromkeys(("materialize", "from_rank0", "write"), 0.0)

    def _part_done(self, name: str, since: float) -> float:
        self._device.synchronize()
        now = time.perf_counter()
        self.parts[name] += now - since
        return now

    def run(self, on_device: set, allocate_on_write: set = frozenset()) -> None:
        # see [Note: releasing the model's own tensors while filling the chunks]
        """Fills the chunks; those in `on_device` live on the device only. Those of them in
        `allocate_on_write` have no copy yet: each gets its device copy (zeroed) right before
        its first value is written, so that the memory the model's own device tensors give back
        as they are released serves the chunks (see the note on releasing above)."""
        self._allocate_on_write = set(allocate_on_write)
        layout, chunks = self._layout, self._chunks
        host = chunks.host_tier
        sharded = self._groups.world_size > 1
        on_cuda = any(device.type == "cuda" for _, device in layout.orig)
        with torch.no_grad():
            for i, p in enumerate(layout.params):
                t = time.perf_counter()
                self._meta.ensure(p)  # a meta-built model gets this parameter's module group now
                t = self._part_done("materialize", t)
                value = self._groups.from_rank0(p.detach())
                t = self._part_done("from_rank0", t)
                self._write(i, p, value, host, on_device)
                del value
                self._part_done("write", t)
                kind = layout.exact_kind(i)
                chunk_dtype = torch.float32 if kind in ("master", "frozen_master") else layout.compute_dtype
                if sharded:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                    self.released_sharded += 1
                elif held_exactly(p.dtype, chunk_dtype):
                    self._released.append((i, layout.handles[(kind, i)], tuple(p.shape)))
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                elif self._meta.materializes(p):  # the initialiser's values, not the caller's: nothing to keep
                    self._released_meta.append((i, tuple(p.shape)))
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._meta.materialize_rest()  # modules with meta buffers only
            for chunk in sorted(self._allocate_on_write):  # a chunk no parameter value reached
                self._allocate_device_copy(chunk)
        if on_cuda:
            torch.cuda.empty_cache()  # released device originals: give their memory to the chunks

    def _write(self, i: int, p: torch.Tensor, value: torch.Tensor, host: str, on_device: set) -> None:
        """Each rank fills the part of each tensor that lies in its shard (all of it unsharded)."""
        layout, chunks = self._layout, self._chunks

        def write(handle, kind):
            if handle[0] in self._allocate_on_write:
                self._allocate_device_copy(handle[0])
            chunks.write_slot(handle, "device" if handle[0] in on_device else layout.home_tier(kind, host), value)

        kinds = layout.kinds_of(i)
        for kind in kinds:
            if kind in ("param", "master", "frozen", "frozen_wide", "frozen_master"):  # values, not companions
                write(layout.handles[(kind, i)], kind)
            chunks.transition(layout.handles[(kind, i)], _C.TensorState.HOLD)

    def _allocate_device_copy(self, chunk: int) -> None:
        """The chunk's device copy, zeroed (its padding never holds garbage). The model's device
        tensors released so far sit in torch's cache: given back to the device when the
        allocation does not fit without them."""
        try:
            self._chunks.allocate_copy(chunk, "device")
        except _C.OutOfMemoryError:
            if not self._device.is_cuda:
                raise
            torch.cuda.empty_cache()
            self._chunks.allocate_copy(chunk, "device")
        self._chunks.shard_view(chunk, "device").zero_()
        self._allocate_on_write.discard(chunk)

    def commit(self) -> None:
        self._released, self._released_meta = [], []

    def rollback(self, exc: BaseException) -> None:
        """enable() failed: notes on `exc` what cannot be given back, and gives every released
        tensor its value back from the chunk holding it exactly."""
        layout = self._layout
        if self.released_sharded:
            exc.add_note(f"gemini_ext: enable() failed after taking {self.released_sharded} of the model's "
                         f"{len(layout.params)} parameters into chunks sharded over {self._groups.world_size} ranks; "
                         "each rank held only its shard, so those parameters are now empty tensors. Build the model "
                         "again before retrying.")
        if self._meta:
            exc.add_note(f"gemini_ext: the model was built on the meta device; enable() had given "
                         f"{self._meta.materialized_modules} of its modules storage on {self._device.torch_device} "
                         "when it failed, the others are still on the meta device. Build the model again before "
                         "retrying.")
        with torch.no_grad():
            for i, handle, shape in self._released:
                tiers = self._chunks.chunk_info(handle[0])["shard_tiers"]
                tier = next(t for t in TIERS if t in tiers)
                dtype, device = layout.orig[i]
                layout.params[i].data = self._chunks.tensor_view(handle, tier).reshape(shape).to(
                    device=device, dtype=dtype, copy=True)
            for i, shape in self._released_meta:  # .data cannot change device type: swap (identity kept)
                p = layout.params[i]
                meta = torch.empty(shape, dtype=layout.orig[i][0], device="meta")
                torch.utils.swap_tensors(p, torch.nn.Parameter(meta, requires_grad=p.requires_grad))
        self._released, self._released_meta = [], []
