"""StatePhases: the engine steps aside between training phases (reinforcement learning's generation
by another inference engine on the same GPU): `offload_states()` moves what the engine holds on
the device to the host and `reload_states()` brings it back, as DeepSpeed's methods of those names.

[Note: offloading the states]
- A lifecycle with two phases, RESIDENT and OFFLOADED (TRANSITIONS below); anything else is
  refused naming the fix: a reload without an offload, an offload twice, a forward or an
  optimizer step while offloaded.
- Offload: the host steps still running finish first (runtime.synchronize). The host must hold
  what leaves the device beside what it holds, counted before anything moves (SPEC §5): what needs
  no new host memory always moves (parameter chunks with a host copy); the parameter chunks
  without one move where the host has room for all of them (the budget evicts them together);
  then each set whose optimizer side (gradient, master, moments) is on the device, in order,
  while the host has room for it. What the host cannot take stays on the device: the call returns
  it (`kept_on_device`) and warns naming the shortfall and the fixes. The pools give their free
  device slots back, and on cuda torch's cache of the engine's freed blocks is emptied.
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
import warnings

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

    def __init__(self, runtime, chunks, layout, device, ranks_on_host: int):
        self._runtime, self._chunks, self._layout, self._device = runtime, chunks, layout, device
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
        free_bytes = host_memory.host_available_bytes(self._ranks_on_host)
        room = float("inf") if free_bytes is None else free_bytes
        kept = {}
        params = "lp_params" in kinds
        if params:
            param_bytes = self._new_host_bytes([s.param for s in self._layout.sets])
            params = param_bytes <= room
            room -= param_bytes if params else 0
            if not params:
                kept["parameter_chunks_bytes"] = param_bytes
        self._move("offload")
        moved = []
        if set(kinds) & set(OPTIMIZER_SIDE):
            for k, place in enumerate(self._runtime.set_placements()):
                if place["trainable"] and not place["optim_on_host"]:
                    need = self._new_host_bytes(list(self._layout.sets[k].optimizer_side().values()))
                    if need > room:
                        kept.setdefault("optimizer_sets", []).append(k)
                        kept["optimizer_bytes"] = kept.get("optimizer_bytes", 0) + need
                        continue
                    room -= need
                    self._runtime.set_optim_on_host(k, True)
                    moved.append(k)
        budget = self._runtime.device_budget
        if params:
            self._runtime.set_device_budget(1)  # below any chunk: every chunk no tensor computes on leaves
        self._saved = (moved, budget)
        released = self._runtime.reclaim_device_bytes(1 << 62)  # the pools' free device slots
        if self._device.is_cuda:
            torch.cuda.empty_cache()
        if kept:
            warnings.warn(_kept_message(kept, free_bytes, bool(moved) or params), stacklevel=3)
        return {"optimizer_sets_moved": len(moved), "released_pool_bytes": released,
                "device_chunk_bytes": self._chunks.tier_bytes("device")["current"], "kept_on_device": kept}

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

    def _new_host_bytes(self, chunk_ids: list) -> int:
        """Bytes the host must newly hold to take these chunks: those on the device without a host
        copy (a parameter chunk whose home is the host evicts to the copy it has)."""
        need = 0
        for chunk_id in chunk_ids:
            info = self._chunks.chunk_info(chunk_id)
            tiers = info["shard_tiers"]
            if "device" in tiers and "host" not in tiers:
                need += info["shard_numel"] * getattr(torch, info["dtype"]).itemsize
        return need


def _kept_message(kept: dict, free_bytes: int | None, moved_any: bool) -> str:
    parts = []
    if "parameter_chunks_bytes" in kept:
        parts.append(f"the parameter chunks ({format_bytes(kept['parameter_chunks_bytes'])} without a host copy)")
    if "optimizer_sets" in kept:
        parts.append(f"the optimizer side of {len(kept['optimizer_sets'])} chunk set(s) "
                     f"({format_bytes(kept['optimizer_bytes'])})")
    return (f"engine.offload_states(): the host has {format_bytes(free_bytes or 0)} available, not enough for "
            f"{' and '.join(parts)}: those stay on the device (the result's 'kept_on_device'); "
            f"{'the rest moved' if moved_any else 'nothing else was asked to move'}. "
            "Free host memory, or use the 8-byte state (GeminiConfig(optimizer_state_dtype='bf16', "
            "master_weights=False)), which halves what the host must hold.")


def _kinds(include) -> tuple:
    if include is None:
        return STATE_KINDS
    names = [getattr(k, "name", k) for k in include]  # DeepSpeed's OffloadStateTypeEnum members carry these names
    unknown = sorted({n for n in names if n not in STATE_KINDS}, key=str)
    if unknown:
        raise ValueError(f"engine.offload_states(include=...): unknown states {unknown}; expected some of "
                         f"{list(STATE_KINDS)} (or None: all).")
    return tuple(names)
