"""GeminiFabricStrategy against Fabric's own single-device run: the small GPT, fp32, clipping
through fabric.clip_gradients; fabric.save / fabric.load resume exactly; the strategy names."""

import copy

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from parity_utils import SMALL, batch, chunk_cap, max_relative_difference
from gemini_ext.models import GPT

fabric_module = pytest.importorskip("lightning.fabric")
from gemini_ext.integrations.fabric import GeminiFabricStrategy  # noqa: E402

def _config(device):
    return gx.GeminiConfig(device=device, precision="fp32", chunk_config_dict={"chunk_size": 4096},
                           **chunk_cap(device, 8 * 4096 * 4))


def _train(fabric, model, opt, steps, first=0):
    for k in range(first, first + steps):
        x, y = batch(SMALL, k, fabric.device)
        fabric.backward(model(x, y))
        fabric.clip_gradients(model, opt, max_norm=0.05)
        opt.step()
        opt.zero_grad()


def _setup(strategy, model, device):
    fabric = fabric_module.Fabric(accelerator="cuda" if device == "cuda" else "cpu", devices=1, precision="32-true",
                                  strategy=strategy)
    fabric.launch()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    model, opt = fabric.setup(model, opt)
    return fabric, model, opt


@pytest.mark.parametrize("device", DEVICES)
def test_fabric_strategy_matches_fabric_and_resumes_exactly(tmp_path, device):
    torch.manual_seed(0)
    straight = GPT(SMALL)
    reference = copy.deepcopy(straight)
    resumed = copy.deepcopy(straight)
    fabric, model, opt = _setup("auto", reference, device)
    _train(fabric, model, opt, 6)
    strategy = GeminiFabricStrategy(_config(device))
    fabric, model, opt = _setup(strategy, straight, device)
    _train(fabric, model, opt, 3)
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": opt, "step": 3})
    _train(fabric, model, opt, 3, first=3)
    assert strategy.engine.stats()["counters"]["evictions"] > 0, "the budget evicts"
    strategy.teardown()
    assert max(max_relative_difference(straight, reference).values()) <= 1e-5
    again = GeminiFabricStrategy(_config(device))
    fabric, model, opt = _setup(again, resumed, device)
    state = {"model": model, "optimizer": opt, "step": 0}
    remainder = fabric.load(tmp_path / "ckpt", state)
    assert state["step"] == 3 and remainder == {}
    assert again.engine.stats()["optimizer_steps"] == 3
    _train(fabric, model, opt, 3, first=3)
    again.teardown()
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name


def test_the_strategy_names_are_in_fabrics_registry():
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    for name in ("gemini", "gemini_auto", "gemini_offload"):
        assert name in STRATEGY_REGISTRY
    strategy = STRATEGY_REGISTRY.get("gemini_auto")
    assert isinstance(strategy, GeminiFabricStrategy) and strategy.config.placement_policy == "auto"
