"""Parameters, gradients and buffers touched from outside the hooks, against plain PyTorch:
engine.clip_grad_norm_ and torch's own clip_grad_norm_ on a managed model, edits through
engine.gathered(writable=True) and in-place writes, buffers after close, and the config's
refusals (fp64 parameters, gpu_memory_limit above the sim device)."""

import math

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from parity_utils import (LR, SMALL, WD, batch, chunk_cap, config, make_models, max_relative_difference,
                          torch_device)

CHUNK_BYTES_FP32 = 4096 * 4


def _reference_steps(model, steps, device, clip=None, edit=None, start=0):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for step in range(start, start + steps):
        if edit is not None and step == edit[0]:
            with torch.no_grad():
                edit[1](model)
        x, y = batch(model.cfg, step, device)
        model(x, y).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return norms


def _train_managed(model, device, steps, before=None, after_backward=None) -> list:
    """Trains `model` under the engine with chunks evicted between the steps; `before(engine,
    step)` runs before each forward, `after_backward(engine)` after each backward (its results are
    returned). Checks that the model's own state dict is the engine's at the end."""
    out = []
    cfg = config(device, **chunk_cap(device, 5 * CHUNK_BYTES_FP32))
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        for step in range(steps):
            if before is not None:
                before(engine, step)
            x, y = batch(model.cfg, step, engine.compute_device)
            model(x, y).backward()
            if after_backward is not None:
                out.append(after_backward(engine))
            opt.step()
            opt.zero_grad()
        inside = model.state_dict()
        assert all(torch.equal(inside[k], v) for k, v in engine.state_dict().items())
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["engine", "torch"])
def test_clipping_matches_torch_clip_grad_norm(device, how):
    model, reference = make_models()
    dev = torch_device(device)
    expected = _reference_steps(reference.to(dev), 4, dev, clip=0.05)  # small enough to clip at every step

    def clip(engine):
        if how == "engine":
            return float(engine.clip_grad_norm_(0.05))
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))

    norms = _train_managed(model, device, 4, after_backward=clip)
    for got, want in zip(norms, expected):
        assert got == pytest.approx(want, rel=1e-5)
    assert min(expected) > 0.05, "the case must clip"
    worst = max(max_relative_difference(model, reference).values())
    assert worst < 1e-5, worst


@pytest.mark.parametrize("norm_type", [1.0, math.inf, 3.0])
def test_clip_grad_norm_of_any_order_is_torchs(norm_type):
    model, reference = make_models()
    x, y = batch(SMALL, 0, "cpu")
    reference(x, y).backward()
    want = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9, norm_type=norm_type))
    with gx.enable(model, config("sim")) as engine:
        engine.optimizer(torch.optim.AdamW)
        model(x, y).backward()
        got = float(engine.clip_grad_norm_(1e9, norm_type=norm_type))
        with pytest.raises(RuntimeError, match="engine.clip_grad_norm_"):
            torch.nn.utils.clip_grad_norm_(list(model.parameters())[:3], 1.0)  # a subset: not clipped silently
    assert got == pytest.approx(want, rel=1e-5)


def test_a_backward_between_clipping_and_the_step_is_refused():
    model, _ = make_models()
    with gx.enable(model, config("sim")) as engine:
        opt = engine.optimizer(torch.optim.AdamW)
        x, y = batch(SMALL, 0, "cpu")
        model(x, y).backward()
        engine.clip_grad_norm_(1e-3)
        model(x, y).backward()
        with pytest.raises(RuntimeError, match="after the last backward"):
            opt.step()


def _halve_and_zero(model):
    model.ln_f.weight.mul_(0.5)
    model.blocks[1].fc1.weight[3].zero_()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["gathered", "gathered_load_state_dict", "in_place"])
def test_edits_between_steps_train_on_exactly_as_on_a_plain_model(device, how):
    model, reference = make_models()
    dev = torch_device(device)
    _reference_steps(reference.to(dev), 4, dev, edit=(2, _halve_and_zero))

    def edit(engine, step):
        if step != 2:
            return
        if how == "gathered":
            with engine.gathered([model.ln_f.weight, model.blocks[1].fc1.weight], writable=True):
                with torch.no_grad():
                    _halve_and_zero(model)
        elif how == "gathered_load_state_dict":  # the edited values loaded as a state dict, inside the block
            edited = {k: v.clone() for k, v in model.state_dict().items()}
            edited["ln_f.weight"].mul_(0.5)
            edited["blocks.1.fc1.weight"][3].zero_()
            with engine.gathered(writable=True):
                model.load_state_dict(edited)
                assert torch.equal(model.ln_f.weight.cpu(), edited["ln_f.weight"]), "the block sees the loaded value"
        else:
            engine.synchronize()  # the CPU steps optimizer.step() left running (overlap_optimizer)
            with torch.no_grad():
                _halve_and_zero(model)

    _train_managed(model, device, 4, before=edit)
    worst = max(max_relative_difference(model, reference).values())
    assert worst < 1e-5, worst


def test_close_inside_gathered_is_refused_and_the_block_still_writes_back():
    """engine.close() inside engine.gathered(writable=True) raises naming the fix (the parameters hold
    the block's copies); the block's end writes the edit back and close() after it gives the model
    the edited values."""
    model, _ = make_models()
    with gx.enable(model, gx.GeminiConfig(device="sim", precision="fp32")) as engine:
        with engine.gathered([model.ln_f.weight], writable=True):
            with torch.no_grad():
                model.ln_f.weight.fill_(0.25)
            with pytest.raises(RuntimeError, match=r"engine.close\(\): inside an engine.gathered\(\) block.*leave"):
                engine.close()
        assert not engine.closed
    assert torch.equal(model.ln_f.weight, torch.full_like(model.ln_f.weight, 0.25))


class _WithBuffers(torch.nn.Module):
    """A float buffer used in forward (like rotary frequencies), one the model updates itself, and
    (cast_buffers=True) BatchNorm, whose statistics must share its weight's dtype."""

    def __init__(self, batch_norm: bool):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.norm = torch.nn.BatchNorm1d(16) if batch_norm else torch.nn.LayerNorm(16)
        self.register_buffer("freq", torch.rand(16) * 1e-3 + 1.0 / 3.0)  # values bf16 cannot hold
        self.register_buffer("seen", torch.zeros(16))

    def forward(self, x):
        with torch.no_grad():
            self.seen += x.detach().abs().mean(0).to(self.seen.dtype)
        return self.norm(self.fc(x) * self.freq.to(x.dtype))


@pytest.mark.parametrize("cast_buffers", [False, True])
def test_buffers_keep_their_dtype_and_come_back_exactly(cast_buffers):
    torch.manual_seed(0)
    model = _WithBuffers(batch_norm=cast_buffers)
    before = {k: v.clone() for k, v in model.named_buffers()}
    freq = model.freq
    cfg = gx.GeminiConfig(device="sim", precision="bf16", chunk_config_dict={"chunk_size": 512},
                          cast_buffers=cast_buffers)
    with gx.enable(model, cfg) as engine:
        assert model.freq.dtype == (torch.bfloat16 if cast_buffers else torch.float32)
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-2)
        for _ in range(2):
            model(torch.randn(8, 16, dtype=torch.bfloat16)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    after = dict(model.named_buffers())
    assert after["freq"].dtype == torch.float32 and torch.equal(after["freq"], before["freq"]), \
        "a buffer the model never changed must come back bit for bit"
    assert after["freq"] is freq
    for changed in ["seen"] + (["norm.running_mean"] if cast_buffers else []):
        assert after[changed].dtype == torch.float32
        assert not torch.equal(after[changed], before[changed]), f"{changed}: the model's own updates stay"
    if cast_buffers:
        assert torch.equal(after["norm.num_batches_tracked"], before["norm.num_batches_tracked"] + 2)


def test_batch_norm_with_16_bit_weights_names_cast_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    with pytest.warns(UserWarning, match="cast_buffers=True"):
        with gx.enable(model, gx.GeminiConfig(device="sim", precision="bf16", chunk_config_dict={"chunk_size": 512})):
            pass


def test_parameters_the_chunks_cannot_represent_are_refused():
    model = torch.nn.Linear(4, 4).double()
    with pytest.raises(TypeError, match=r"'weight'.*float64.*model.float\(\)"):
        gx.enable(model, config("sim"))
    assert model.weight.dtype == torch.float64 and model.weight.numel() == 16, "refused before anything was touched"
    half = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="masters start from those values"):
        with gx.enable(half, config("sim", precision="fp32")):
            pass
    assert half.weight.dtype == torch.bfloat16


def test_gpu_memory_limit_is_the_planning_budget_on_sim_too():
    model, _ = make_models()
    limit = 5 * CHUNK_BYTES_FP32
    with gx.enable(model, config("sim", gpu_memory_limit=limit)) as engine:
        opt = engine.optimizer(torch.optim.AdamW)
        x, y = batch(SMALL, 0, "cpu")
        model(x, y).backward()
        opt.step()
        stats = engine.stats()
    assert stats["tier_bytes"]["device"]["peak"] <= limit
    assert stats["counters"]["evictions"] > 0
    with pytest.raises(ValueError, match="gpu_memory_limit.*sim_capacity"):
        gx.GeminiConfig(device="sim", gpu_memory_limit="2MiB", sim_capacity="1MiB")


@pytest.mark.cuda
def test_pageable_host_copies_are_refused_on_cuda_and_served_by_gathered():
    model, _ = make_models()
    with gx.enable(model, config("cuda", pin_memory=False, offload_param_frac=1.0)) as engine:
        w = model.blocks[0].fc1.weight
        with pytest.raises(RuntimeError, match="pin_memory=False"):
            w.sum()
        expected = engine.state_dict()["blocks.0.fc1.weight"]
        with engine.gathered([w]):
            assert torch.equal(w.detach().cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_a_dtype_or_device_conversion_inside_the_block_is_undone_and_refused(device):
    """model.half(), .float(), .to(dtype) swap each parameter's .data for a copy no chunk holds
    (training would silently go on from a stale copy): the next forward gives the chunk views
    back and raises naming precision=; training then goes on exactly as without the conversion.
    Conversions that change nothing pass; close() after one warns and restores the dtypes."""
    model, reference = make_models()
    dev = torch_device(device)
    reference.to(dev)
    _reference_steps(reference, 3, dev)
    with gx.enable(model, config(device, precision="fp32")) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        for step, convert in enumerate((lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.double())):
            engine.synchronize()  # the last step's CPU work done: the conversion reads every parameter
            convert(model)
            x, y = batch(model.cfg, step, dev)
            with pytest.raises(RuntimeError, match="converted inside the gx.enable block.*precision="):
                model(x, y)
            assert all(p.dtype == torch.float32 for p in model.parameters())
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        engine.synchronize()
        model.float()  # what it is already: nothing to undo
        model.to(engine.compute_device)
        model(*batch(model.cfg, 3, dev))
        engine.synchronize()
        model.half()
        with pytest.warns(UserWarning, match="conversion was undone"):
            engine.close()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert max(max_relative_difference(model, reference).values()) <= 1e-5
