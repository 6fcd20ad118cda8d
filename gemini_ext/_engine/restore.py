"""Giving the model back at close(): ordinary parameters holding the trained values.

[Note: closing a model that fills memory]
A model that needed chunks split over host and device has no room for its restored tensors
beside all of its chunks (13B: 52 GB of fp32 parameters going back to the GPU while the optimizer
state of 38 of 62 chunk sets fills it). The optimizer is detached at close, so its state, the
gradients and the speculative spares are dropped first and their memory (whole arena extents:
one per chunk group and tier) goes back to the system before any tensor is restored. Parameters
then come back a chunk set at a time, the sets whose master is on the device first, each set's
master dropped right after, so memory is given back as it is taken. Sharded, every rank does the
same drops in the same order (the reads are all-gathers).
"""

from __future__ import annotations

import warnings

import torch

from .._env import logger
from ..placement.host_memory import host_available_bytes
from ..placement.costs import HOST_TIERS, TIERS
from .._units import format_bytes


def restore_free_bytes(chunks, device, ranks_on_host: int) -> int | None:
    """Memory this rank can give the whole model at close: the host budget of this rank
    (placement/host_memory.py) and what the host chunks hold, plus, on cuda, the device's free memory and what
    the chunks hold there (all freed as the parameters come back, or after). None where host
    memory cannot be read."""
    host = host_available_bytes(ranks_on_host)
    if host is None:
        return None
    free_bytes = host + sum(chunks.tier_bytes(t)["current"] for t in HOST_TIERS)
    if device.is_cuda:
        free_bytes += device.free_bytes() + chunks.tier_bytes("device")["current"]
    return free_bytes


class ModelRestorer:
    """close()'s work on the chunks and parameters; the engine drops its references after."""

    def __init__(self, runtime, chunks, layout, groups, device):
        self._runtime = runtime
        self._chunks = chunks
        self._layout = layout
        self._groups = groups
        self._device = device  # ComputeDevice
        self.staged_params = 0         # parameters that waited on the host for device memory
        self.params_left_on_host = 0   # of those, the ones that did not fit their device at the end

    def restore(self, release_optimizer_spares) -> tuple[bool, list[int]]:
        """Parameters read back from the chunks (see the note above). Returns (whether the
        values were restored, the parameters staged on the host to move once the chunks are
        freed)."""
        layout, runtime = self._layout, self._runtime
        with torch.no_grad():
            placements = runtime.set_placements()
            params_of_set = {}
            for i, s in enumerate(layout.set_of_param()):
                params_of_set.setdefault(s, []).append(i)
            release_optimizer_spares()
            for chunks in layout.sets:
                self.drop_set_state(chunks, tuple(k for k in chunks.optimizer_side() if k != "master"))
            self.trim_chunk_memory()
            # A model sharded because no device holds it may not fit this rank's device and host
            # even once the chunks are freed (80B in fp32 is 324 GB, on every rank). The reads
            # below are collective, so every rank skips them if any rank lacks the room. The
            # remaining chunks count as room (masters go set by set as parameters come back):
            # only a model that cannot fit at all is refused.
            whole, free_bytes = layout.whole_model_bytes(), restore_free_bytes(self._chunks, self._device,
                                                                         self._groups.ranks_on_host())
            if not self._groups.all_agree(free_bytes is None or whole <= free_bytes):
                self._leave_empty(whole, free_bytes)
                return False, []
            staged = self._read_back(placements, params_of_set)
            runtime.release_read_cache()
        return True, staged

    def _read_back(self, placements: list[dict], params_of_set: dict) -> list[int]:
        # Values go straight from their chunk to their device (read_to: no round trip through
        # pageable host memory). What does not fit on the device (arena extents that other
        # groups' chunks keep partly in use) waits on the host until every chunk is freed. Sharded,
        # each read all-gathers its chunk on the device: a parameter goes to the device only while
        # the device's free memory leaves room for the next gather after it, or that collective
        # fails on a full device (30B over 2 GPUs did, at 876 MiB). Blocks torch caches unused do
        # not count: they may lie between live tensors (there, 8.7 GiB cached, in pieces too small
        # for the gather).
        # see [Note: closing a model that fills memory]
        layout, runtime = self._layout, self._runtime
        staged = []
        reserve = self._gather_reserve_bytes()
        cpu = torch.device("cpu")
        for s in sorted(params_of_set, key=lambda s: placements[s]["optim_on_host"]):
            for i in params_of_set[s]:
                dtype, device = layout.orig[i]
                value = None
                if device.type != "cuda" or torch.cuda.mem_get_info(device)[0] >= (
                        layout.numels[i] * (dtype.itemsize + 4) + reserve):
                    try:
                        value = runtime.read_to("param", i, device, dtype)
                    except torch.OutOfMemoryError:  # after the gather (cached): reading again is local
                        pass
                if value is None:
                    value = runtime.read_to("param", i, cpu, dtype)
                    staged.append(i)
                layout.params[i].data = value
                layout.params[i].grad = None
            self.drop_set_state(layout.sets[s], ("master",))
        self.staged_params = len(staged)
        if staged:
            logger.info("close: %d parameters waited on the host for device memory held by chunks", len(staged))
        return staged

    def _gather_reserve_bytes(self) -> int:
        """Device bytes a sharded read at close may take: the largest chunk read, gathered whole,
        beside its shard copied to the device (0 unsharded: reads copy their slot only)."""
        if not self._chunks.sharded:
            return 0
        reserve = 0
        for chunks in self._layout.sets:
            read = chunks.master if chunks.master >= 0 else chunks.param
            info = self._chunks.chunk_info(read)
            item = 4 if read == chunks.master else self._layout.compute_dtype.itemsize
            reserve = max(reserve, (info["padded_numel"] + info["shard_numel"]) * item)
        return reserve + (64 << 20)  # and the collective's own workspace

    def _leave_empty(self, whole: int, free_bytes: int | None) -> None:
        """For a model no rank has room for: each parameter is left an empty tensor of its
        original dtype and device (see the warning at enable)."""
        layout = self._layout
        with torch.no_grad():
            for i, p in enumerate(layout.params):
                dtype, device = layout.orig[i]
                p.data = torch.empty(0, dtype=dtype, device=device)
                p.grad = None
        here = f"{format_bytes(free_bytes)} here" if free_bytes is not None else "unknown here"
        warnings.warn(
            f"gemini_ext close(): the whole model ({format_bytes(whole)}) does not fit the device and host memory of "
            f"every rank once its chunks are freed ({here}); the {len(layout.params)} parameters are left empty and "
            "their trained values were not kept by close(). Save them inside the `with` block with "
            "engine.save_checkpoint(dir) (sharded; loads at any world size), then load that checkpoint into a "
            "model built on the meta device.", stacklevel=4)

    def detach(self) -> None:
        """The chunks are about to be freed: let go of the manager and the runtime."""
        self._runtime = self._chunks = None

    def move_staged_params(self, staged: list[int]) -> None:
        """The last step of close(), once the chunks are freed: parameters that waited on the host
        go to their device. A model sharded because one GPU cannot hold it cannot come back whole
        onto one GPU: what does not fit stays on the host, holding its values, and a warning says
        so (nothing is lost; raising here would leave the model half-moved)."""
        layout = self._layout
        left = []
        with torch.no_grad():
            for i in staged:
                try:
                    layout.params[i].data = layout.params[i].data.to(layout.orig[i][1])
                except torch.OutOfMemoryError:
                    left.append(i)
        self.params_left_on_host = len(left)
        if left:
            nbytes = sum(layout.params[i].numel() * layout.params[i].element_size() for i in left)
            device = layout.orig[left[0]][1]
            warnings.warn(
                f"gemini_ext close(): {len(left)} of {len(layout.params)} parameters ({format_bytes(nbytes)}) stay on "
                f"the host: {device} has no room for the whole model once its chunks are freed (sharded over "
                f"{self._groups.world_size} rank(s), the model did not have to fit one device). They hold the trained "
                "values; to keep a model this size, call engine.save_checkpoint() or engine.state_dict() inside the "
                "`with` block, or move the parameters yourself where they fit.", stacklevel=4)

    def drop_set_state(self, chunks, kinds) -> None:
        """Frees every copy of the given kinds ("grad", "master", state kinds) of a chunk set."""
        ids = chunks.optimizer_side()
        for kind in kinds:
            cid = ids.get(kind, -1)
            if cid < 0:
                continue
            self._chunks.wait(cid)  # a move in flight (a gradient offload) finishes first
            tiers = self._chunks.chunk_info(cid)["shard_tiers"]
            for tier in TIERS:
                if tier in tiers:
                    self._chunks.discard_copy(cid, tier)

    def trim_chunk_memory(self) -> None:
        """Gives the chunk pools' free slots and wholly free arena extents back to the system."""
        self._runtime.synchronize()  # the freed slots' last uses are complete
        for tier in TIERS:
            self._chunks.trim(tier)
