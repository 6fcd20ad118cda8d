"""engine.stats()["throughput"]: tokens counted from the model's forwards, FLOPs per token from the
parameters (or the config), step times between optimizer steps, MFU against a peak."""

import pytest
import torch

import gemini_ext as gx
from parity_utils import batch, config, make_models


def _run(model, cfg, steps=3, micro_batches=1, evaluate=False):
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        for step in range(steps):
            for micro in range(micro_batches):
                x, y = batch(model.cfg, step * micro_batches + micro, engine.compute_device)
                model(x, y).backward()
            if evaluate:
                with torch.no_grad():
                    model(x, y)  # not a training token
            opt.step()
            opt.zero_grad()
        return engine.stats()["throughput"]


def test_tokens_flops_and_mfu_of_training_steps():
    model, _ = make_models()
    n = sum(p.numel() for p in model.parameters())
    figures = _run(model, config("sim", peak_tflops=2.0), micro_batches=2, evaluate=True)
    assert figures["flops_per_token"] == 6 * n, "every parameter trains: 6 N"
    assert figures["tokens_per_step"] == 2 * 4 * 16, "both micro-batches of 4 x 16 tokens, not the evaluation"
    assert figures["steps_timed"] == 2, "the first step (warm-up) is left out"
    assert figures["tokens_per_s"] > 0 and figures["step_seconds"] > 0
    assert figures["model_tflops_per_s"] == pytest.approx(figures["tokens_per_s"] * 6 * n / 1e12)
    assert figures["mfu"] == pytest.approx(figures["model_tflops_per_s"] / 2.0)


def test_frozen_parameters_cost_no_weight_gradient_and_the_config_overrides():
    model, _ = make_models()
    model.tok_emb.weight.requires_grad_(False)
    n = sum(p.numel() for p in model.parameters())
    frozen = model.tok_emb.weight.numel()
    figures = _run(model, config("sim"), steps=2)
    assert figures["flops_per_token"] == 4 * n + 2 * (n - frozen)
    assert figures["peak_tflops"] is None and figures["mfu"] is None, "sim has no peak: no MFU"
    assert figures["tokens_per_s"] > 0
    model, _ = make_models()
    figures = _run(model, config("sim", flops_per_token=1e9, peak_tflops=1.0), steps=2)
    assert figures["flops_per_token"] == 1e9 and figures["flops_per_token_source"] == "config"
    assert figures["mfu"] == pytest.approx(figures["tokens_per_s"] * 1e9 / 1e12)


@pytest.mark.parametrize("field", ["flops_per_token", "peak_tflops"])
def test_throughput_fields_refuse_what_is_not_a_positive_number(field):
    with pytest.raises(ValueError, match=f"{field}: expected a number > 0"):
        gx.GeminiConfig(**{field: 0})
