"""StatePhases: the engine steps aside between training phases (reinforcement learning's generation
by another inference engine on the same GPU): `offload_states()` moves what the engine holds on
the device to the host and `reload_states()` brings it back, as DeepSpeed's methods of those names.

[Note: offloading the states]
- A lifecycle with two phases, RESIDENT and OFFLOADED (TRANSITIONS below); anything else is
  refused naming the fix: a reload without an offload, an offload twice, a forward or an
  optimizer step while offloaded.
- Offload: the host steps still running finish first (runtime.synchronize). The host must hold
  what leaves the device beside what it holds: checked before anything moves (SPEC §5), refused
  naming the shortfall. Then every set whose optimizer side (gradient, master, moments) is on the
  device moves it to the host, the chunks' device budget drops to nothing so every parameter chunk
  is evicted to its host copy, the pools give their free device slots back, and on cuda torch's
  cache of the engine's freed blocks is emptied.
- Reload: the optimizer sides go back to the device and the budget is the one before; the
  parameter chunks the next forward computes with first start copying back at once (as many as
  the budget holds, on the copy stream: Residency::prefetch_next_forward), the rest as the
  forward reaches them (prefetched ahead as always). Sharded, the forward gathers them as before.
  The values are the same bytes: training after the round trip is bit-identical.
- `include` names what moves, in DeepSpeed's words: "optim_states", "hp_params" and "lp_grads" are
  one chunk set's optimizer side in this engine and move together; "lp_params" are the parameter
  chunks.
"""

from __future__ import annotations

import enum

import torch

from .._units import format_bytes
from ..placement import host_memory


class Phase(enum.Enum):
    RESIDENT = "resident"
    OFFLOADED = "offloaded"


TRANSITIONS = {  # (from, action) -> to
    (Phase.RESIDENT, "offload"): Phase.OFFLOADED,
    (Phase.OFFLOADED, "reload"): Phase.RESIDENT,
}
OPTIMIZER_SIDE = ("optim_states", "hp_params", "lp_grads")
STATE_KINDS = OPTIMIZER_SIDE + ("lp_params",)


class StatePhases:
    """Moves the engine's device memory to the host and back (see [Note: offloading the states])."""

    def __init__(self, runtime, chunks, device, ranks_on_host: int):
        self._runtime, self._chunks, self._device = runtime, chunks, device
        self._ranks_on_host = ranks_on_host
        self.phase = Phase.RESIDENT
        self._saved = None  # (sets moved to the host, the budget before)

    def _move(self, action: str) -> None:
        to = TRANSITIONS.get((self.phase, action))
        if to is None:
            fix = ("call engine.reload_states() first" if self.phase is Phase.OFFLOADED
                   else "call engine.offload_states() first")
            raise RuntimeError(f"engine.{action}_states(): the engine's states are {self.phase.value}; {fix}.")
        self.phase = to

    def check_resident(self, what: str) -> None:
        if self.phase is Phase.OFFLOADED:
            raise RuntimeError(f"{what}: the engine's states are offloaded (engine.offload_states()); call "
                               "engine.reload_states() before training again.")

    def offload(self, include=None) -> dict:
        kinds = _kinds(include)
        if self.phase is Phase.OFFLOADED:
            self._move("offload")  # raises
        self._runtime.synchronize()
        self._check_host_free_bytes(kinds)
        self._move("offload")
        moved = []
        if set(kinds) & set(OPTIMIZER_SIDE):
            for k, place in enumerate(self._runtime.set_placements()):
                if place["trainable"] and not place["optim_on_host"]:
                    self._runtime.set_optim_on_host(k, True)
                    moved.append(k)
        budget = self._runtime.device_budget
        if "lp_params" in kinds:
            self._runtime.set_device_budget(1)  # below any chunk: every chunk no tensor computes on leaves
        self._saved = (moved, budget)
        released = self._runtime.reclaim_device_bytes(1 << 62)  # the pools' free device slots
        if self._device.is_cuda:
            torch.cuda.empty_cache()
        return {"optimizer_sets_moved": len(moved), "released_pool_bytes": released,
                "device_chunk_bytes": self._chunks.tier_bytes("device")["current"]}

    def reload(self) -> int:
        self._move("reload")
        moved, budget = self._saved
        self._saved = None
        self._runtime.set_device_budget(budget)
        for k in moved:
            self._runtime.set_optim_on_host(k, False)
        # the forward's first chunks, copied back now on the copy stream: the next step does not wait for them
        return self._runtime.prefetch_next_forward()

    def detach(self) -> None:
        """Lets go of the manager and the chunks (the engine closes)."""
        self._runtime = self._chunks = None

    def _new_host_bytes(self, kinds) -> int:
        """Bytes the host must newly hold: the chunks of the asked kinds on the device without a host
        copy (a parameter chunk whose home is the host evicts to the copy it has)."""
        params, optimizer = "lp_params" in kinds, bool(set(kinds) & set(OPTIMIZER_SIDE))
        need = 0
        for chunk_id in range(self._chunks.num_chunks):
            info = self._chunks.chunk_info(chunk_id)
            tiers = info["shard_tiers"]
            if "device" not in tiers or "host" in tiers or not (params if info["group"] == "param" else optimizer):
                continue
            need += info["shard_numel"] * getattr(torch, info["dtype"]).itemsize
        return need

    def _check_host_free_bytes(self, kinds) -> None:
        leaving = self._new_host_bytes(kinds)
        free_bytes = host_memory.host_available_bytes(self._ranks_on_host)
        if free_bytes is not None and leaving > free_bytes:
            raise MemoryError(f"engine.offload_states(): {format_bytes(leaving)} of the engine's device memory would "
                              f"move to the host, which has {format_bytes(free_bytes)} available for it: "
                              f"{format_bytes(leaving - free_bytes)} short. Free host memory, or offload fewer states "
                              "(include=['lp_params'] moves only the parameter chunks).")


def _kinds(include) -> tuple:
    if include is None:
        return STATE_KINDS
    names = [getattr(k, "name", k) for k in include]  # DeepSpeed's OffloadStateTypeEnum members carry these names
    unknown = sorted({n for n in names if n not in STATE_KINDS}, key=str)
    if unknown:
        raise ValueError(f"engine.offload_states(include=...): unknown states {unknown}; expected some of "
                         f"{list(STATE_KINDS)} (or None: all).")
    return tuple(names)
