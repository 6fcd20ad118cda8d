"""The `static` and `const` placement policies: the documented chunks for each fraction, the
limit planned for chunks and activations, and const's budget."""

import pytest
import torch

import gemini_ext as gx
from parity_utils import config
from placement_utils import four_layers, train_four_layers


@pytest.mark.parametrize("frac", [0.0, 0.5, 1.0])
def test_static_fractions_select_the_documented_chunks(frac):
    model = four_layers()
    with gx.enable(model, config("sim", offload_param_frac=frac, offload_optim_frac=frac)) as engine:
        placements = engine.internal.runtime.set_placements()
        stats = engine.stats()["placement"]
    n = round(4 * frac)
    assert [p["param_home_on_host"] for p in placements] == [True] * n + [False] * (4 - n), "params: from the front"
    assert [p["optim_on_host"] for p in placements] == [False] * (4 - n) + [True] * n, "optimizer: from the back"
    assert stats["optim_chunks_on_host"] == n and stats["param_chunks_home_host"] == n


@pytest.mark.cuda
def test_static_plans_the_limit_for_chunks_and_activations():
    """Under static, gpu_memory_limit caps chunks and torch's allocations together: after the
    first iteration the chunk budget is the limit minus what torch needed (its peak, or what its
    allocator holds if more) minus the headroom (1/16 of that, at least 256 MiB) minus the memory
    held outside torch (the CUDA context, cuBLAS's workspace): a limit is what a card of that size
    holds."""
    from gemini_ext.placement import policies as policy
    model = four_layers()
    limit = 4 << 30
    torch.cuda.empty_cache()  # what earlier tests left cached would count as this one's (it is held from the device)
    with gx.enable(model, config("cuda", gpu_memory_limit=limit)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        assert engine.stats()["device_budget_bytes"] == limit, "the first iteration runs with the whole limit"
        for _ in range(2):
            x = torch.randn(16384, 64, device=engine.compute_device)  # 4 MiB activations per layer
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        stats = engine.stats()
    first = stats["steps"][0]["non_model_peak_bytes"]
    assert first >= 4 * (4 << 20), "four layers' activations were measured"
    decision = stats["placement"]["decision"]
    assert decision["decisions"] == 1 and decision["non_model_peak_bytes"] == first
    need = max(first, decision["non_model_reserved_bytes"])
    headroom = max(policy.NON_MODEL_HEADROOM_MIN, int(need * policy.NON_MODEL_HEADROOM))
    outside = decision["device_other_bytes"]
    # This process's CUDA context at least, on any GPU; after the whole cuda suite (NCCL, compiled
    # kernels, cuBLAS on several streams) about 1.4 GiB on an H100, so the limit leaves room beyond it.
    assert outside > 0, outside
    assert stats["device_budget_bytes"] == limit - need - headroom - outside > 0
    assert stats["steps"][-1]["device_bytes_peak"] <= stats["device_budget_bytes"]


def test_static_keeps_the_whole_capacity_on_sim():
    model = four_layers()
    with gx.enable(model, config("sim", sim_capacity=1 << 20)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        train_four_layers(model, engine, opt, 2)
        stats = engine.stats()
    assert stats["device_budget_bytes"] == 1 << 20 and stats["placement"]["decision"] == {}


def test_const_needs_its_budget():
    with pytest.raises(ValueError, match="const_gpu_budget"):
        gx.enable(four_layers(), config("sim", placement_policy="const"))
