"""Numerical parity with plain PyTorch: a small GPT trained for 20 steps.

fp32: every parameter within 1e-5 relative of torch.optim.AdamW after 20 steps, under every
policy (static placements, const, auto) and under device budgets so small that chunks are
evicted and fetched every step, with and without prefetching. bf16 and fp16: the loss curve within bf16/fp16 tolerance
of
plain PyTorch under autocast (fp32 master weights on both sides). Runs on `sim` in CI and on
cuda on the GPU machine.
"""

import pytest
import torch

from conftest import DEVICES
from parity_utils import (SMALL, chunk_cap, config, make_models, max_relative_difference, torch_device, train_gemini,
                          train_reference)

STEPS = 20
CHUNK_BYTES_FP32 = 4096 * 4

# name -> GeminiConfig overrides. The budget cases leave room for about five chunks, so every
# step evicts and fetches (asserted below through the counters).
PLACEMENTS = {
    "optim_on_host": {},
    "optim_on_device": {"offload_optim_frac": 0.0},
    "half_and_half": {"offload_optim_frac": 0.5, "offload_param_frac": 0.5},
    "params_home_on_host": {"offload_param_frac": 1.0},
    "tiny_budget": {"budget_chunks": 5},
    "tiny_budget_optim_on_device_half": {"budget_chunks": 20, "offload_optim_frac": 0.5},
    "const_tiny_budget": {"placement_policy": "const", "const_gpu_budget": 5 * CHUNK_BYTES_FP32},
    "auto": {"placement_policy": "auto"},
    "auto_small_device": {"placement_policy": "auto", "budget_chunks": 40},
    "no_prefetch_tiny_budget": {"budget_chunks": 5, "max_prefetch": 0},
}


def _overrides(device, case):
    kw = dict(PLACEMENTS[case])
    chunks = kw.pop("budget_chunks", None)
    if chunks is not None:
        if kw.get("placement_policy") == "auto":  # the limit covers chunks and activations
            kw["gpu_memory_limit" if device == "cuda" else "sim_capacity"] = chunks * CHUNK_BYTES_FP32
        else:
            kw.update(chunk_cap(device, chunks * CHUNK_BYTES_FP32))
    return kw


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(PLACEMENTS))
def test_fp32_parameters_match_torch_adamw(device, case):
    model, reference = make_models()
    dev = torch_device(device)
    ref_losses = train_reference(reference, STEPS, dev)
    losses, stats = train_gemini(model, STEPS, config(device, **_overrides(device, case)))
    diffs = max_relative_difference(model, reference)
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= 1e-5, f"{worst}: {diffs[worst]:.3g} relative"
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert stats["optimizer_steps"] == STEPS
    if ("budget" in case and "auto" not in case) or "home_on_host" in case:
        assert stats["counters"]["evictions"] >= STEPS, "chunks must be evicted every step"
        assert stats["counters"]["fetches"] >= STEPS
    if "budget" in case:
        o = _overrides(device, case)
        limit = o.get("const_gpu_budget") or o.get("sim_capacity") or o["gpu_memory_limit"]
        assert stats["tier_bytes"]["device"]["peak"] <= limit


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision,dtype,tolerance", [("bf16", torch.bfloat16, 2e-2), ("fp16", torch.float16, 5e-3)])
def test_16bit_loss_curves_match_torch_autocast(device, precision, dtype, tolerance):
    model, reference = make_models()
    ref_losses = train_reference(reference, STEPS, torch_device(device), dtype=dtype)
    for overrides in ({}, {"offload_optim_frac": 0.0}):
        fresh, _ = make_models()
        losses, stats = train_gemini(fresh, STEPS, config(device, precision=precision, **overrides))
        assert losses == pytest.approx(ref_losses, rel=tolerance), overrides
        assert losses[-1] < losses[0] - 0.1, "it learns"
        assert stats["skipped_steps"] == 0
        assert all(p.dtype == torch.float32 for p in fresh.parameters()), "restored in their own dtype"


@pytest.mark.parametrize("device", DEVICES)
def test_adam_with_l2_weight_decay_matches(device):
    model, reference = make_models()
    train_reference(reference, 10, torch_device(device), opt_cls=torch.optim.Adam, weight_decay=0.01)
    train_gemini(model, 10, config(device), opt_cls=torch.optim.Adam, weight_decay=0.01)
    diffs = max_relative_difference(model, reference)
    assert max(diffs.values()) <= 1e-5, diffs


def test_small_model_really_spans_many_chunks():
    import gemini_ext as gx
    model, _ = make_models()
    with gx.enable(model, config("sim")) as engine:
        assert engine.stats()["num_param_chunks"] >= 10
    assert SMALL.qkv_bias is False
