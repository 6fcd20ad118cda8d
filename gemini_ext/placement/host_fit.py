"""Whether the host holds what a placement puts in host memory, checked before the memory is taken.

[Note: the host holds the plan, the sim device included]
What a placement puts on the host is counted from its chunk sets: a trainable set's parameter
chunk has a host copy (unless it is born on the device), and where its optimizer steps on the
host its gradient, fp32 master and optimizer state live there too; a frozen set's parameter
chunk lives there when that is its home, and its exact fp32 values always. The `sim` device is
host memory as well: its chunks (the parameter copies it caches, up to its capacity, and the
optimizer side of the sets stepped there) are counted with the host's. enable() checks what it
allocates (every chunk but the optimizer state, which comes with the optimizer), and
engine.optimizer() the state of its optimizer's kinds, each against the host budget of that
moment (host_memory.py; at enable() plus what the model's own host tensors give back as the
chunks are filled) less the reserve every plan keeps for the process (policies/base.py). A plan
that does not fit raises gx.OutOfMemoryError with the figures before the memory is taken, where
the kernel's out-of-memory killer would otherwise end the process.

Tests that emulate a machine whose host is smaller than this one's (placement tests on sim) set
SIM_DEVICE_IS_HOST_MEMORY to False: their sim device then stands for that machine's GPU.
"""

from __future__ import annotations

import dataclasses

from .._native import _C
from .._units import format_bytes
from .costs import STATE_DTYPE
from .policies.base import host_reserve_bytes

SIM_DEVICE_IS_HOST_MEMORY = True


@dataclasses.dataclass(frozen=True)
class HostDemand:
    host_bytes: int        # chunks on the host tiers
    sim_device_bytes: int  # chunks on the sim device (host memory as well); 0 on cuda

    @property
    def total_bytes(self) -> int:
        return self.host_bytes + self.sim_device_bytes


def enable_demand(layout, placement, device_kind: str, capacity_bytes: int) -> HostDemand:
    """The host memory of the chunks enable() allocates under `placement` (no optimizer state)."""
    item = layout.compute_dtype.itemsize
    master = STATE_DTYPE.itemsize if layout.has_master else 0
    host, device = layout.frozen_master_shard_bytes(), 0  # the exact values of frozen parameters
    for chunks, place, shard in zip(layout.sets, placement.sets, layout.shard_bytes):
        elements = shard // item
        if not chunks.trainable:
            if place.param_home_on_host:
                host += shard
            else:
                device += shard
            continue
        optimizer_side = elements * (item + master)  # gradient and master
        if place.optim_on_host:
            host += shard + optimizer_side
            device += shard  # the copy compute reads
        else:
            device += shard + optimizer_side
            host += 0 if placement.params_born_on_device else shard
    return _demand(host, device, device_kind, capacity_bytes)


def optimizer_demand(layout, placements: list[dict], state_kinds: int, device_kind: str,
                     capacity_bytes: int) -> HostDemand:
    """The host memory of the optimizer state chunks an optimizer with `state_kinds` kinds adds
    (`placements`: the manager's set_placements() now)."""
    item = layout.compute_dtype.itemsize
    state_item = layout.state_dtype.itemsize
    host = device = 0
    for chunks, place, shard in zip(layout.sets, placements, layout.shard_bytes):
        if not chunks.trainable:
            continue
        nbytes = shard // item * state_item * state_kinds
        if place["optim_on_host"]:
            host += nbytes
        else:
            device += nbytes
    return _demand(host, device, device_kind, capacity_bytes, device_cap=False)


def plan_host_bytes(layout, placement, state_kinds: int) -> int:
    """The host bytes of the chunks `placement` puts there with an optimizer of `state_kinds` kinds: what
    enable() and engine.optimizer() check, together (gx.estimate's host figure)."""
    placements = [{"optim_on_host": s.optim_on_host} for s in placement.sets]
    return (enable_demand(layout, placement, "cuda", 0).host_bytes
            + optimizer_demand(layout, placements, state_kinds, "cuda", 0).host_bytes)


def _demand(host: int, device: int, device_kind: str, capacity_bytes: int, device_cap: bool = True) -> HostDemand:
    if device_kind != "sim" or not SIM_DEVICE_IS_HOST_MEMORY:
        return HostDemand(host, 0)
    return HostDemand(host, min(device, capacity_bytes) if device_cap else device)


def check(demand: HostDemand, available: int | None, source: str | None, what: str, fixes: str) -> None:
    # see [Note: the host holds the plan, the sim device included]
    """Raises gx.OutOfMemoryError where `demand` exceeds `available` less the reserve kept for the
    process (None: the host's memory cannot be read, nothing is checked)."""
    if available is None:
        return
    reserve = host_reserve_bytes(available)
    free_bytes = available - reserve
    if demand.total_bytes <= free_bytes:
        return
    sim = (f" and {format_bytes(demand.sim_device_bytes)} on the sim device, which lives in host memory"
           if demand.sim_device_bytes else "")
    raise _C.OutOfMemoryError(
        f"gemini_ext: {what} needs {format_bytes(demand.total_bytes)} of host memory "
        f"({format_bytes(demand.host_bytes)} of chunks on the host{sim}), and the host has "
        f"{format_bytes(available)} available ({source or 'host memory'}) less {format_bytes(reserve)} kept for the "
        f"process: {format_bytes(demand.total_bytes - free_bytes)} short. Nothing was allocated for it. To train this "
        f"model, {fixes}.")
