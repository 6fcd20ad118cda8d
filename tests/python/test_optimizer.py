"""GeminiOptimizer: clipping, fp16 loss scaling, gradient accumulation, LR schedulers, param
groups and torch-compatible state dicts, each against plain PyTorch."""

import math

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from parity_utils import (LR, WD, batch, config, make_models, max_relative_difference, torch_device, train_gemini,
                          train_reference, train_step)


def test_optimizer_arguments_are_checked():
    model, _ = make_models()
    with gx.enable(model, config("sim")) as engine:
        with pytest.raises(TypeError, match="list is not a torch.optim.Optimizer class"):
            engine.optimizer(list, lr=0.1)
        with pytest.raises(TypeError, match="pass the class itself"):
            engine.optimizer(gx.GeminiOptimizer)
        with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
            engine.optimizer(torch.optim.SGD, lr=0.1, nesterov=True)
        with pytest.raises(ValueError, match="betas must be in"):
            engine.optimizer(gx.optim.Lion, betas=(0.9, 1.5))
        with pytest.raises(TypeError, match="unexpected argument 'momentum' for Adagrad"):
            engine.optimizer(torch.optim.Adagrad, momentum=0.9)
        with pytest.raises(ValueError, match="amsgrad=True"):
            engine.optimizer(torch.optim.AdamW, amsgrad=True)
        with pytest.raises(ValueError, match="maximize=True"):
            engine.optimizer(torch.optim.Adam, maximize=True)
        with pytest.raises(TypeError, match="momentum"):
            engine.optimizer(torch.optim.AdamW, momentum=0.9)
        with pytest.raises(ValueError, match="lr must be >= 0"):
            engine.optimizer(torch.optim.AdamW, lr=-1.0)
        engine.optimizer(torch.optim.AdamW, lr=1e-3, fused=True)  # implementation flags are accepted
        with pytest.raises(RuntimeError, match="already has an optimizer"):
            engine.optimizer(torch.optim.AdamW)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offload_optim_frac", [1.0, 0.0])
def test_global_norm_clipping_matches_clip_grad_norm(device, offload_optim_frac):
    model, reference = make_models()
    train_reference(reference, 10, torch_device(device), max_norm=0.05)
    _, stats = train_gemini(model, 10, config(device, max_norm=0.05, offload_optim_frac=offload_optim_frac))
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_adam_steps_the_same_bits_on_either_tier(device, state_dtype):
    """Every set's optimizer state on the device (the CUDA kernel on cuda, the CPU kernel on sim)
    against every set's on the host: the same arithmetic, the same 16-bit copies and, for bf16
    moments, the same rounding, so the same parameters bit for bit (the serial step: a first step
    guessed during backward and corrected for clipping is within ulps, test_speculation.py)."""
    runs = []
    for frac in (1.0, 0.0):
        model, _ = make_models()
        cfg = config(device, precision="bf16", max_norm=0.05, optimizer_state_dtype=state_dtype,
                     offload_optim_frac=frac, overlap_optimizer=False)
        losses, stats = train_gemini(model, 8, cfg)
        runs.append((model, losses, stats["placement"]["optim_chunks_on_device"]))
    (host, host_losses, host_sets), (dev, dev_losses, dev_sets) = runs
    assert host_sets == 0 and dev_sets == stats["num_param_chunks"]
    assert host_losses == dev_losses
    for a, b in zip(host.parameters(), dev.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["accumulate", "no_sync", "config"])
def test_gradient_accumulation_matches_plain_pytorch(device, mode):
    model, reference = make_models()
    train_reference(reference, 6, torch_device(device), micro_batches=3)
    cfg = config(device, enable_gradient_accumulation=(mode == "config"))
    _, stats = train_gemini(model, 6, cfg, micro_batches=3, use_no_sync=(mode == "no_sync"))
    assert max(max_relative_difference(model, reference).values()) <= 1e-5
    if mode != "accumulate":
        # gradients stayed on the device until the last micro-batch: one offload per chunk and step
        assert stats["counters"]["grad_chunks_offloaded"] == 6 * stats["num_param_chunks"]


@pytest.mark.parametrize("device", DEVICES)
def test_lr_scheduler_and_param_groups(device):
    model, reference = make_models()
    dev = torch_device(device)
    reference.to(dev)

    def groups(m):
        decay = [p for n, p in m.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in m.named_parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0, "lr": 2 * LR}]

    ref_opt = torch.optim.AdamW(groups(reference), lr=LR)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    with gx.enable(model, config(device)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, params=groups(model), lr=LR)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        for step in range(8):
            train_step(model, opt, step, dev)
            sched.step()
            train_step(reference, ref_opt, step, dev)
            ref_sched.step()
        assert opt.param_groups[1]["lr"] == pytest.approx(ref_opt.param_groups[1]["lr"])
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offload_optim_frac", [1.0, 0.0])
def test_fp16_overflow_skips_the_step_and_backs_off(device, offload_optim_frac):
    model, _ = make_models()
    cfg = config(device, precision="fp16", initial_scale=2.0**24, max_scale=2.0**32, hysteresis=1,
                 offload_optim_frac=offload_optim_frac)
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR)
        before = engine.state_dict()
        x, y = batch(model.cfg, 0, engine.compute_device)
        model(x, y).backward()  # gradients scaled by 2**24 overflow fp16
        opt.step()
        opt.zero_grad()
        assert engine.stats()["skipped_steps"] == 1
        assert engine.internal.scaler.scale == 2.0**23
        after = engine.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step changes nothing"
        assert opt.state_dict()["state"] == {}, "no step counted"
        losses = []
        for step in range(30):
            x, y = batch(model.cfg, step, engine.compute_device)
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        stats = engine.stats()
        assert stats["optimizer_steps"] > 0 and stats["loss_scale"] < 2.0**23
        assert stats["optimizer_steps"] + stats["skipped_steps"] == 31
        finite = [value for value in losses if math.isfinite(value)]
        assert finite[-1] < finite[0] - 0.1


def test_loss_scaler_rules():
    s = gx.DynamicLossScaler(initial_scale=1024, min_scale=256, growth_factor=2, backoff_factor=0.5,
                             growth_interval=3, hysteresis=2, max_scale=2048)
    s.update(True)
    assert s.scale == 1024, "hysteresis: the first overflow does not back off"
    s.update(True)
    assert s.scale == 512
    for _ in range(3):
        s.update(False)
    assert s.scale == 1024
    for _ in range(9):
        s.update(False)
    assert s.scale == 2048, "capped at max_scale"
    for _ in range(10):
        s.update(True)
    assert s.scale == 256, "floored at min_scale"
    t = gx.DynamicLossScaler(1, 1, 2, 0.5, 1, 1, 2)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_is_torch_adamw_format_both_ways(device):
    model, reference = make_models()
    dev = torch_device(device)
    reference.to(dev)
    with gx.enable(model, config(device)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        for step in range(3):
            train_step(model, opt, step, dev)
        state = opt.state_dict()
        reference.load_state_dict(engine.state_dict())
    # Ours into torch's AdamW, and both continue identically.
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    ref_opt.load_state_dict(state)
    assert ref_opt.state_dict()["state"][0]["step"].item() == 3
    fresh, _ = make_models()
    with gx.enable(fresh, config(device)) as engine:
        engine.load_state_dict(reference.state_dict())
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        opt.load_state_dict(ref_opt.state_dict())  # torch's into ours
        for step in range(3, 6):
            train_step(fresh, opt, step, dev)
            train_step(reference, ref_opt, step, dev)
    assert max(max_relative_difference(fresh, reference).values()) <= 1e-5


def test_model_zero_grad_clears_the_gradient_chunks():
    """transformers' Trainer calls model.zero_grad(), not the optimizer's: it must clear the chunks
    (else the next step adds the old gradients in), and a part of the model cannot be cleared alone."""
    model, _ = make_models()
    with gx.enable(model, config("sim")) as engine:
        engine.optimizer(torch.optim.AdamW)
        x, y = batch(model.cfg, 0, engine.compute_device)
        model(x, y).backward()
        assert engine.grad(model.ln_f.weight) is not None
        with pytest.raises(RuntimeError, match="only some of the parameters"):
            model.blocks[0].zero_grad()
        model.zero_grad()
        assert all(engine.grad(p) is None for p in model.parameters())
        plain = torch.nn.Linear(2, 2)  # an unmanaged module while an engine is open: torch's own behaviour
        plain(torch.ones(1, 2)).sum().backward()
        plain.zero_grad()
        assert plain.weight.grad is None


class _CountingRuntime:
    """Stands in for the manager where the optimizer and the engine's parts reach it (the hooks
    keep their own reference) and records each call made through it."""

    def __init__(self, runtime):
        self._runtime, self.calls = runtime, []

    def __getattr__(self, name):
        attr = getattr(self._runtime, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)
        return call


@pytest.mark.parametrize("precision, max_norm", [("fp32", 0.0), ("fp16", 1.0)])
def test_a_step_makes_at_most_four_calls_into_the_manager(precision, max_norm):
    model, _ = make_models()
    with gx.enable(model, config("sim", precision=precision, max_norm=max_norm, offload_optim_frac=1.0)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        train_step(model, opt, 0, engine.compute_device)  # the first iteration records the trace
        parts = engine.internal
        counting = parts.runtime = _CountingRuntime(parts.runtime)
        x, y = batch(model.cfg, 1, engine.compute_device)
        loss = model(x, y)
        counting._runtime.hold_optimizer_thread(True)  # the CPU steps (started in backward) stay pending after step()
        loss.backward()
        counting.calls.clear()  # what backward's start asked for (speculation) is not the step's
        opt.step()
        assert len(counting.calls) <= 4, counting.calls
        assert counting.calls[-1] == "optimizer_step", counting.calls
        assert ("grad_norm_sq" in counting.calls) == (precision == "fp16" or max_norm > 0), counting.calls
        parts.runtime = counting._runtime
        first = next(iter(model.parameters()))
        with pytest.raises(RuntimeError, match="being stepped by the CPU optimizer"):
            first.detach().sum()  # the guard is part of the step: no separate call to forget
        parts.runtime.hold_optimizer_thread(False)
        engine.synchronize()
        assert all(torch.isfinite(p.detach()).all() for p in model.parameters())


def test_parameters_are_taken_as_torch_takes_them():
    """engine.optimizer(cls, model.parameters()) (a generator, positionally or by name) and groups
    given as a generator of dicts train as torch.optim does; a lone tensor is refused as torch
    refuses it."""
    model, reference = make_models()
    ref_opt = torch.optim.AdamW([{"params": [p for n, p in reference.named_parameters() if "ln" in n], "lr": 2 * LR},
                                 {"params": [p for n, p in reference.named_parameters() if "ln" not in n]}],
                                lr=LR, weight_decay=WD)
    for step in range(3):
        train_step(reference, ref_opt, step, torch.device("cpu"))
    for form in ("positional", "keyword", "groups"):
        model, _ = make_models()
        with gx.enable(model, config("sim")) as engine:
            if form == "positional":
                opt = engine.optimizer(torch.optim.AdamW, model.parameters(), lr=LR, weight_decay=WD)
            elif form == "keyword":
                opt = engine.optimizer(torch.optim.AdamW, params=model.parameters(), lr=LR, weight_decay=WD)
            else:
                def params(norms, named=model.named_parameters):  # a generator per group
                    return (p for n, p in named() if ("ln" in n) == norms)
                opt = engine.optimizer(torch.optim.AdamW, ({"params": params(norms), **extra}
                                                           for norms, extra in ((True, {"lr": 2 * LR}), (False, {}))),
                                       lr=LR, weight_decay=WD)
            assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters())), form
            for step in range(3):
                train_step(model, opt, step, torch.device("cpu"))
        if form == "groups":
            assert max(max_relative_difference(model, reference).values()) <= 1e-5
    model, _ = make_models()
    with gx.enable(model, config("sim")) as engine:
        with pytest.raises(TypeError, match="got a single Parameter"):
            engine.optimizer(torch.optim.AdamW, next(model.parameters()), lr=LR)


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.RMSprop])
def test_frozen_parameters_in_the_optimizers_list_are_kept_and_never_stepped(opt_cls):
    """torch.optim takes parameters with requires_grad=False and never steps them (PEFT's examples
    pass model.parameters()): so does the engine's optimizer, native or generic, and its state
    dict has torch's layout (groups list every parameter, state only the stepped ones)."""
    model, reference = make_models()
    for m in (model, reference):
        m.blocks[0].requires_grad_(False)
    ref_opt = opt_cls(reference.parameters(), lr=LR)
    with gx.enable(model, config("sim")) as engine:
        opt = engine.optimizer(opt_cls, model.parameters(), lr=LR)
        assert len(opt.param_groups[0]["params"]) == len(list(model.parameters()))
        for step in range(3):
            train_step(model, opt, step, torch.device("cpu"))
            train_step(reference, ref_opt, step, torch.device("cpu"))
        ours, theirs = opt.state_dict(), ref_opt.state_dict()
        assert sorted(ours["state"]) == sorted(theirs["state"])
        assert ours["param_groups"][0]["params"] == theirs["param_groups"][0]["params"]
        opt.load_state_dict(ours)
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


def test_training_under_the_engine_imports_no_dynamo():
    """torch wraps Optimizer.add_param_group so that dynamo does not trace it, and that wrapper's
    first call imports torch._dynamo: over a second of CPU (and 70 MB) in every process that builds
    an optimizer. The engine's optimizer and hooks import none of it (transformers' models do)."""
    from conftest import run_python
    code = ("import sys, torch, gemini_ext as gx\n"
            "model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))\n"
            "with gx.enable(model, gx.GeminiConfig(device='sim')) as e:\n"
            "    opt = e.optimizer(torch.optim.AdamW, lr=1e-3)\n"
            "    for _ in range(2):\n"
            "        x = torch.ones(4, 8, device=e.compute_device, dtype=torch.bfloat16)\n"
            "        model(x).float().square().sum().backward()\n"
            "        opt.step()\n"
            "        opt.zero_grad()\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n")
    out = run_python("-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
