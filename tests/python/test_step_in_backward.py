"""The step in backward (GeminiConfig.optimizer_step_in_backward): host chunk sets stepped in
place while backward runs.

Exactness: the same losses and parameters, bit for bit, as the serial step (every set stepped
in step(), nothing overlapped), with the state on the host, split with the device, under a tight
device budget, with the link lane stepping some sets, and with gradients accumulated under
no_sync() or enable_gradient_accumulation. That the steps ran during backward: after
loss.backward() and before step(), the host sets are already stepped. What would make it differ
from step() raises: clipping or fp16 in the config, a clip that would scale, a second backward
or zero_grad() before step(), a foreign optimizer; hyperparameters changed after backward began
give a full step with the backward's values and an error. On `sim` in CI, on cuda on the GPU
machine.
"""

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from parity_utils import CHUNK, LR, WD, batch, chunk_cap, host_sets_with_link_lane, make_models

CASES = {
    "fp32_on_host": {"precision": "fp32"},
    "bf16_split": {"precision": "bf16", "offload_optim_frac": 0.5, "offload_param_frac": 0.5},
    "tiny_budget": {"precision": "fp32", "budget_chunks": 5},
}
AUTO = {"precision": "bf16", "placement_policy": "auto", "sim_capacity": 40 * 4096 * 4}  # sim: keeps host sets


def _config(device, case, in_backward, **extra):
    kw = {**(AUTO if case == "auto" else CASES[case]), **extra}
    chunks = kw.pop("budget_chunks", None)
    if chunks is not None:
        kw.update(chunk_cap(device, chunks * 4096 * 4))
    return gx.GeminiConfig(device=device, chunk_config_dict=CHUNK, overlap_optimizer=in_backward,
                           optimizer_step_in_backward=in_backward, **kw)


def _train(device, case, in_backward, steps=4, micro_batches=1, link_every=0, lrs=None, **extra):
    """Trains; returns (losses, final parameters, host sets stepped during each last backward).
    Micro-batches but the last run under no_sync() unless `extra` accumulates by config."""
    model, _ = make_models()
    losses, started = [], []
    with gx.enable(model, _config(device, case, in_backward, **extra)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        host_sets = host_sets_with_link_lane(engine, link_every)
        for step in range(steps):
            if lrs is not None:
                for g in opt.param_groups:
                    g["lr"] = lrs[step]
            total = 0.0
            for micro in range(micro_batches):
                x, y = batch(model.cfg, step * micro_batches + micro, engine.compute_device)
                accumulate = micro < micro_batches - 1 and not extra.get("enable_gradient_accumulation")
                with engine.no_sync() if accumulate else _nothing():
                    loss = model(x, y) / micro_batches
                    loss.backward()
                total += loss.item()
            started.append(opt.steps_started_in_backward() if in_backward else 0)
            opt.step()
            opt.zero_grad()
            losses.append(total)
    params = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    return losses, params, started, len(host_sets)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _assert_same(a, b):
    assert a[0] == b[0], "losses"
    for name, value in a[1].items():
        assert torch.equal(b[1][name], value), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_steps_in_backward_equal_the_serial_step_bit_for_bit(device, case):
    serial = _train(device, case, in_backward=False)
    in_backward = _train(device, case, in_backward=True)
    _assert_same(serial, in_backward)
    assert in_backward[3] >= 2, "the case is meant to keep several sets' state on the host"
    assert all(n == in_backward[3] for n in in_backward[2]), (in_backward[2], "every host set started in backward")


@pytest.mark.parametrize("device", DEVICES)
def test_the_link_lane_and_accumulation_keep_it_exact(device):
    serial = _train(device, "bf16_split", in_backward=False, micro_batches=2)
    _assert_same(serial, _train(device, "bf16_split", in_backward=True, micro_batches=2, link_every=2))
    by_config = _train(device, "bf16_split", in_backward=True, micro_batches=2, enable_gradient_accumulation=True)
    _assert_same(serial, by_config)
    assert by_config[2] == [0] * 4, "gradients kept on the device until step(): the steps start there"


def test_auto_plans_for_the_backward_window_and_stays_exact():
    serial = _train("sim", "auto", in_backward=False)
    in_backward = _train("sim", "auto", in_backward=True)
    _assert_same(serial, in_backward)
    assert min(in_backward[2]) > 0, in_backward[2]
    model, _ = make_models()
    with gx.enable(model, _config("sim", "auto", True)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        x, y = batch(model.cfg, 0, engine.compute_device)
        model(x, y).backward()
        opt.step()
        assert engine.stats()["placement"]["decision"]["optimizer_window"] == "backward"


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match=r"max_norm=1.0 needs that norm first"):
        gx.GeminiConfig(device="sim", optimizer_step_in_backward=True, max_norm=1.0)
    with pytest.raises(ValueError, match=r"precision='fp16'"):
        gx.GeminiConfig(device="sim", optimizer_step_in_backward=True, precision="fp16")
    with pytest.raises(ValueError, match=r"optimizer_step_in_backward: expected True or False"):
        gx.GeminiConfig(device="sim", optimizer_step_in_backward=1)
    model, _ = make_models()
    with gx.enable(model, _config("sim", "fp32_on_host", True)) as engine:
        with pytest.raises(ValueError, match=r"RMSprop has none"):
            engine.optimizer(torch.optim.RMSprop, lr=LR)
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        x, y = batch(model.cfg, 0, engine.compute_device)
        model(x, y).backward()
        assert opt.steps_started_in_backward() > 0
        norm = engine.clip_grad_norm_(float("inf"))  # reading the norm scales nothing: allowed
        assert norm.item() > 0
        with pytest.raises(RuntimeError, match=r"would be scaled.*optimizer_step_in_backward=True"):
            engine.clip_grad_norm_(norm.item() / 2)
        with pytest.raises(RuntimeError, match=r"a backward pass began while \d+ chunk sets"):
            model(x, y).backward()
        with pytest.raises(RuntimeError, match=r"zero_grad\(\) after a backward pass that stepped"):
            opt.zero_grad()
        opt.step()
        opt.zero_grad()
        assert opt.steps_started_in_backward() == 0
        model(x, y).backward()  # the engine goes on as usual after the refusals
        opt.step()
        model(x, y)  # settles every host set
        stats = opt.last_step_stats()  # the sets stepped during backward count to the step
        assert stats["host_params"] > 0 and stats["host_seconds"] > 0 and stats["pending_sets"] == 0, stats


def test_hyperparameters_changed_after_backward_complete_the_step_with_the_backwards_and_raise():
    lrs = [LR, LR, LR * 3, LR * 3]  # step 2 runs at the backward's LR (step 1's), then LR * 3 from step 3
    expected = _train("sim", "fp32_on_host", in_backward=False, lrs=[LR, LR, LR, LR * 3])
    model, _ = make_models()
    losses = []
    with gx.enable(model, _config("sim", "fp32_on_host", True)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        for step in range(4):
            x, y = batch(model.cfg, step, engine.compute_device)
            loss = model(x, y)
            loss.backward()
            for g in opt.param_groups:
                g["lr"] = lrs[step]
            if step == 2:
                with pytest.raises(RuntimeError, match=r"hyperparameters changed after backward began"):
                    opt.step()
            else:
                opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    params = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    _assert_same(expected, (losses, params))
