"""A plan the host cannot hold is refused with the figures before its memory is taken, whatever
the policy; on sim the device's chunks count as host memory (placement/host_fit.py). Without
this the kernel's out-of-memory killer ended the process inside engine.optimizer()."""

import pytest
import torch

import gemini_ext as gx
from gemini_ext.placement import host_fit, host_memory
from parity_utils import config, make_models


def _host(monkeypatch, available):
    monkeypatch.setattr(host_memory, "host_budget",
                        lambda *args, **kwargs: host_memory.HostBudget(available, "a test's figure"))


def _demands(cfg):
    """(enable's demand, AdamW's state's demand) of make_models()'s model under `cfg`, and the
    bytes of its own host tensors (given back at enable)."""
    model, _ = make_models()
    with gx.enable(model, cfg) as engine:
        parts = engine.internal
        capacity = parts.device.capacity_bytes()
        at_enable = host_fit.enable_demand(parts.layout, parts.placer.current, parts.device.kind, capacity)
        states = host_fit.optimizer_demand(parts.layout, parts.runtime.set_placements(), 2, parts.device.kind,
                                           capacity)
    return at_enable, states, sum(p.numel() * 4 for p in make_models()[0].parameters())


def _available_for(room):
    """The host figure that leaves `room` once the reserve (1/8 at these sizes) is kept."""
    return -(-room * 8 // 7) + 1


@pytest.mark.parametrize("device,policy", [("sim", "static"), ("sim", "auto"),
                                           pytest.param("cuda", "static", marks=pytest.mark.cuda)])
def test_a_plan_the_host_cannot_hold_is_refused_at_enable_and_the_model_kept(monkeypatch, device, policy):
    """static keeps the optimizer state on the host; auto on sim, whose device is host memory, has
    nowhere else to put it (auto on cuda puts this small model on the device: nothing to refuse)."""
    model, _ = make_models()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _host(monkeypatch, 1 << 16)  # far less than the parameters' host copies
    with pytest.raises(gx.OutOfMemoryError, match=r"enable\(\) needs .* of host memory .* short") as err:
        gx.enable(model, config(device, precision="bf16", placement_policy=policy))
    assert ("sim device, which lives in host memory" in str(err.value)) == (device == "sim")
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def test_the_optimizer_state_the_host_cannot_hold_is_refused_before_it_is_allocated(monkeypatch):
    """enable() fits; the AdamW state does not (on sim, wherever the placement puts it)."""
    cfg = config("sim", precision="bf16")
    at_enable, states, released = _demands(cfg)
    assert states.total_bytes > 0
    _host(monkeypatch, _available_for(at_enable.total_bytes) - released)  # what enable() needs, with the release
    model, _ = make_models()
    with gx.enable(model, cfg) as engine:
        _host(monkeypatch, _available_for(states.total_bytes) - 1024)  # what is left after it: a little too little
        tiers = engine.stats()["tier_bytes"]
        with pytest.raises(gx.OutOfMemoryError, match=r"optimizer's state \(2 kind\(s\) per parameter\) needs"):
            engine.optimizer(torch.optim.AdamW, lr=1e-3)
        assert engine.stats()["tier_bytes"] == tiers, "nothing was allocated for it"
        engine.optimizer(torch.optim.SGD, lr=1e-3)  # stateless: fits


def test_on_sim_the_device_counts_as_host_memory(monkeypatch):
    """The same host figure holds the plan when the sim device stands for a separate GPU (as the
    placement tests emulate), and not when it is this host's memory, as it is."""
    cfg = config("sim", precision="bf16", placement_policy="static")
    at_enable, _, released = _demands(cfg)
    assert at_enable.sim_device_bytes > 0
    _host(monkeypatch, _available_for(at_enable.host_bytes) - released)
    with pytest.raises(gx.OutOfMemoryError, match="on the sim device"):
        gx.enable(make_models()[0], cfg)
    monkeypatch.setattr(host_fit, "SIM_DEVICE_IS_HOST_MEMORY", False)
    with gx.enable(make_models()[0], cfg):
        pass
