"""Where a step's time goes: the engine's work in torch.profiler's trace (the chunk moves and the
waits on the thread that needs them, each host set's step on its lane's thread: csrc/core/trace_ranges.h),
named so that a trace opened in Perfetto or TensorBoard shows it, and each lane's busy time in
engine.stats()["lanes"] (_engine/lanes.py)."""

import collections
import json
import os
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import gemini_ext as gx
from conftest import DEVICES, REPO
from parity_utils import CHUNK, LR, batch, make_models

sys.path.insert(0, os.path.join(REPO, "bench"))
import timeline  # noqa: E402


def _iteration(model, engine, opt, step):
    x, y = batch(model.cfg, step, engine.compute_device)
    with record_function("test.backward"):
        model(x, y).backward()
    with record_function("test.step"):
        opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("device", DEVICES)
def test_the_trace_shows_host_steps_on_their_lane_and_the_waits_for_them_where_they_are_needed(device, tmp_path):
    model, _ = make_models()
    # static: the optimizer on the host, so every set's step is a host step
    with gx.enable(model, gx.GeminiConfig(device=device, precision="fp32", chunk_config_dict=CHUNK)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR)
        for step in range(2):
            _iteration(model, engine, opt, step)
        engine.synchronize()  # no step of these runs on into the trace: each traced wait has its step traced
        engine.internal.runtime.set_optimizer_task_delay_us(5_000)  # slow steps: the caller waits for some
        with profile(activities=[ProfilerActivity.CPU]) as prof:  # the copies on cuda: their ranges at launch
            _iteration(model, engine, opt, 2)
            x, _ = batch(model.cfg, 3, engine.compute_device)
            model(x)  # the next forward settles what is left
        sets = sum(p["trainable"] and p["optim_on_host"] for p in engine.internal.runtime.set_placements())
    events = [e for e in prof.events() if e.name.startswith(("gx.", "test."))]
    kinds = collections.Counter(e.name.split(" set ")[0].split(" chunk ")[0] for e in events)
    caller = next(e.thread for e in events if e.name == "test.backward")
    steps = {int(e.name.rsplit(" ", 1)[1]): e for e in events if e.name.startswith("gx.cpu ")}
    assert len(steps) == sets, kinds
    lanes = {e.thread for e in steps.values()}
    assert caller not in lanes, "host steps run on the optimizer's thread"
    waits = [e for e in events if e.name.startswith("gx.wait set ")]
    assert waits and all(e.thread not in lanes for e in waits), kinds  # the caller's (or autograd's on cuda)
    for wait in waits:  # each wait ends once the step it waited for ended
        step = steps[int(wait.name.rsplit(" ", 1)[1])]
        assert wait.time_range.start <= step.time_range.end <= wait.time_range.end + 1, (wait, step)
    backward = next(e for e in events if e.name == "test.backward")
    first = min(steps.values(), key=lambda e: e.time_range.start)
    assert first.time_range.start >= backward.time_range.start, "no step starts before the gradients"
    moves = [e for e in events if e.name.startswith("gx.move chunk ") or e.name.startswith("gx.copy chunk ")]
    assert moves and all(e.thread not in lanes for e in moves), kinds  # in backward: autograd's thread on cuda
    # bench/timeline.py draws the exported trace: a row per lane, each with its ranges
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    rows = timeline.lanes(json.loads((tmp_path / "trace.json").read_text()))
    counts = {k: len(v) for k, v in rows.items()}
    assert counts["CPU lane: host steps"] == sets and counts["waits"] == len(waits), counts
    assert rows["copies device to host"], "the gradients' copies to the host"


@pytest.mark.parametrize("device", DEVICES)
def test_the_stats_name_each_lanes_busy_time_and_the_lane_that_bounds_the_step(device):
    model, _ = make_models()
    with gx.enable(model, gx.GeminiConfig(device=device, precision="fp32", chunk_config_dict=CHUNK)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR)
        assert engine.stats()["lanes"]["bound"] is None, "no step yet"
        engine.internal.runtime.set_optimizer_task_delay_us(20_000)  # the CPU lane: at least 0.2 s a step
        for step in range(3):
            _iteration(model, engine, opt, step)
        stats = engine.stats()
        sets = sum(p["trainable"] and p["optim_on_host"] for p in engine.internal.runtime.set_placements())
    lanes = stats["lanes"]
    assert lanes["busy_seconds"]["cpu"] >= sets * 0.02, "every host set's step, settled before the last backward"
    assert lanes["bound"] == "cpu", lanes
    assert 0 < lanes["busy_seconds"]["gpu"] < lanes["busy_seconds"]["cpu"]
    assert lanes["line"].startswith("cpu bounds the step") and "gpu idles" in lanes["line"], lanes["line"]
    assert {"device_optimizer", "link"} <= set(lanes["unused"]), lanes["unused"]  # static
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lanes["elements"] == {"cpu": trainable, "link": 0, "device_optimizer": 0}, lanes["elements"]
    assert lanes["bytes"]["d2h"] > 0 and lanes["bytes"]["h2d"] > 0, lanes["bytes"]  # gradients down, parameters up
    assert 0 < lanes["waits"]["step_call"] < lanes["step_seconds"], lanes["waits"]  # step() returns before the host
