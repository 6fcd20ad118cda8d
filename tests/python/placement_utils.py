"""Helpers of the placement tests: the host's memory as a test wants it, and Measurements with
defaults."""

import torch

import gemini_ext as gx
from parity_utils import config, make_models

CHUNK_BYTES = 4096 * 4


def host_budget(monkeypatch, available):
    """The host budget reads `available` bytes (placement/host_memory.py): the host of a machine
    the test emulates, whose GPU the sim device stands for (its memory is not this host's)."""
    from gemini_ext.placement import host_fit, host_memory
    monkeypatch.setattr(host_fit, "SIM_DEVICE_IS_HOST_MEMORY", False)
    budget = host_memory.HostBudget(available, "a test's figure")
    monkeypatch.setattr(host_memory, "host_budget", lambda *args, **kwargs: budget)
    monkeypatch.setattr(host_memory, "host_available_bytes", lambda *args, **kwargs: available)


def host_with_free_bytes(monkeypatch, room):
    """The host reports memory leaving `room` bytes to plan once its reserve is kept, and the
    model's own host tensors are not counted as given back (the plan then equals `room`)."""
    from gemini_ext.placement import placer as _placement, policies as policy
    available = min(a for a in (room + policy.HOST_RESERVE_BYTES, -(-room * 8 // 7))
                    if a - policy.host_reserve_bytes(a) >= room)
    host_budget(monkeypatch, available)
    monkeypatch.setattr(_placement.Placer, "_releasable_host_bytes", lambda self: 0)


def measured(**kw):
    from gemini_ext.placement.policies import Measurements
    base = dict(device_kind="cuda", allocator_mode="default", device_capacity_bytes=100 << 30,
                device_total_bytes=100 << 30, set_shard_bytes=(1 << 30,) * 4, trainable=(True,) * 4,
                set_bytes_per_element=14, compute_itemsize=2, sharded=False, world_size=1)
    return Measurements(**{**base, **kw})


def four_layers(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])  # one chunk each


def train_four_layers(model, engine, opt, steps):
    for _ in range(steps):
        x = torch.randn(8, 64, device=engine.compute_device)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def param_chunk_bytes(device):
    """The 16-bit (here fp32) bytes of each parameter chunk of make_models()'s model, in order."""
    with gx.enable(make_models()[0], config(device)) as probe:
        chunks, runtime = probe.internal.chunks, probe.internal.runtime
        return [chunks.chunk_info(p["param_chunk"])["shard_numel"] * 4 for p in runtime.set_placements()]
