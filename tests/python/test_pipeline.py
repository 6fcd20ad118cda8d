"""The overlapped CPU optimizer step (GeminiConfig.overlap_optimizer, on by default).

Exactness: training with the step overlapped equals training with the serial step bit for bit,
under clipping that triggers, fp16 loss scaling, gradient accumulation, tight device budgets
(chunks evicted while steps are pending), optimizer state split between host and device, and the
auto policy. AdamW speculates in place (its guesses confirmed here; corrections and undos have
their own tolerances in test_speculation.py); Lion, which has no correction, speculates with
spare copies, whose drops are exact. Overlap: step() returns while the CPU work is still pending, zero_grad does not
wait
for it, and the next forward (or any read of the state) settles it. On `sim` in CI, on cuda on
the GPU machine.
"""

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from parity_utils import CHUNK, LR, SMALL, WD, batch, chunk_cap, host_sets_with_link_lane, make_models

CHUNK_BYTES_FP32 = 4096 * 4

CASES = {
    "fp32": {"precision": "fp32"},
    "bf16_clipping": {"precision": "bf16", "max_norm": 0.05},  # small enough that it clips every step
    "fp16_scaler": {"precision": "fp16", "initial_scale": 2.0**20},  # overflows first: skipped steps
    "tiny_budget": {"precision": "fp32", "budget_chunks": 5},
    "half_on_device": {"precision": "bf16", "offload_optim_frac": 0.5, "offload_param_frac": 0.5},
    "auto": {"precision": "bf16", "placement_policy": "auto"},
    "bf16_clipping_never_triggers": {"precision": "bf16", "max_norm": 1e6},  # speculation from step 2 on
}
LANE_CASES = {**CASES, "split_clipping": {**CASES["half_on_device"], "max_norm": 0.05}}
# Cases whose overlapped run must have confirmed speculative steps (started during backward).
# (auto on sim moves every optimizer state to the device after the first step: nothing to speculate)
SPECULATES = {"fp32", "tiny_budget", "half_on_device", "bf16_clipping_never_triggers"}
NEVER_ARMED = {"fp16_scaler", "bf16_clipping"}  # a loss scale, or clipping that triggers every step
ADAMW, LION = torch.optim.AdamW, gx.optim.Lion  # speculates in place; with spares


def _config(device, case, overlap):
    kw = dict(LANE_CASES[case])
    chunks = kw.pop("budget_chunks", None)
    if chunks is not None:
        kw.update(chunk_cap(device, chunks * CHUNK_BYTES_FP32))
    return gx.GeminiConfig(device=device, chunk_config_dict=CHUNK, overlap_optimizer=overlap, **kw)


def _train(device, case, overlap, steps=6, micro_batches=1, read_state_after=None, before_step=None,
           optimizer=ADAMW):
    """Trains; returns (losses, final parameters, optimizer state read right after step
    `read_state_after`, skipped steps, speculation stats). before_step(step, model, engine, opt) runs
    between the last backward and optimizer.step()."""
    model, _ = make_models()
    losses, early_state = [], None
    with gx.enable(model, _config(device, case, overlap)) as engine:
        opt = engine.optimizer(optimizer, lr=LR, weight_decay=WD)
        for step in range(steps):
            total = 0.0
            for micro in range(micro_batches):
                x, y = batch(model.cfg, step * micro_batches + micro, engine.compute_device)
                loss = model(x, y) / micro_batches
                loss.backward()
                total += loss.item()
            if before_step is not None:
                before_step(step, model, engine, opt)
            opt.step()
            if step == read_state_after:  # before zero_grad and the next forward: steps may be pending
                early_state = opt.state_dict()
            opt.zero_grad()
            losses.append(total)
        skipped = engine.stats()["skipped_steps"]
        speculation = opt.speculation_stats()
    params = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    return losses, params, early_state, skipped, speculation


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", [ADAMW, LION], ids=["adamw_in_place", "lion_spares"])
@pytest.mark.parametrize("case", list(CASES))
def test_overlapped_step_equals_the_serial_step_bit_for_bit(device, case, optimizer):
    if optimizer is ADAMW and case == "bf16_clipping":
        pytest.skip("AdamW's first clipped step is corrected, within ulps: test_speculation.py")
    serial = _train(device, case, overlap=False, optimizer=optimizer)
    overlapped = _train(device, case, overlap=True, optimizer=optimizer)
    assert overlapped[0] == serial[0], "losses"
    for name, value in serial[1].items():
        assert torch.equal(overlapped[1][name], value), name
    assert overlapped[3] == serial[3]
    if case == "fp16_scaler":
        assert serial[3] > 0, "the case is meant to skip steps on overflow"
    spec = overlapped[4]
    assert serial[4]["confirmed"] == serial[4]["in_place"]["guessed"] == 0, "no speculation without overlap"
    if case in SPECULATES and optimizer is ADAMW:
        assert spec["in_place"]["guessed"] > 0 and spec["in_place"]["corrected"] == 0, spec
        assert spec["confirmed"] == 0 and spec["spare_bytes"] == 0, spec
    elif case in SPECULATES:
        assert spec["confirmed"] > 0 and spec["spare_bytes"] > 0 and spec["in_place"]["guessed"] == 0, spec
    elif case in NEVER_ARMED:
        assert spec["confirmed"] == spec["dropped"] == spec["in_place"]["guessed"] == 0, spec


def _set_lr(step, model, engine, opt):
    if step % 2 == 1:  # edited after backward began: the speculative steps guessed the old value
        for g in opt.param_groups:
            g["lr"] = g["lr"] * 0.5


def _read_state(step, model, engine, opt):
    if step == 2:
        opt.state_dict()  # settles every set before step(): their speculations are dropped


def _extra_backward(step, model, engine, opt):
    if step == 3:  # a second backward adds to gradients whose step already started
        x, y = batch(SMALL, 100 + step, engine.compute_device)
        model(x, y).backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("intervene", [_set_lr, _read_state, _extra_backward],
                         ids=["lr_changed_after_backward", "state_read_before_step", "second_backward_before_step"])
def test_wrong_or_overtaken_speculation_is_dropped_and_the_result_stays_exact(device, intervene):
    serial = _train(device, "fp32", overlap=False, before_step=intervene, optimizer=LION)
    overlapped = _train(device, "fp32", overlap=True, before_step=intervene, optimizer=LION)
    assert overlapped[0] == serial[0]
    for name, value in serial[1].items():
        assert torch.equal(overlapped[1][name], value), name
    assert overlapped[4]["dropped"] > 0 and overlapped[4]["confirmed"] > 0, overlapped[4]


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_accumulation_and_reading_state_right_after_step(device):
    serial = _train(device, "bf16_clipping", overlap=False, micro_batches=2, read_state_after=2, optimizer=LION)
    overlapped = _train(device, "bf16_clipping", overlap=True, micro_batches=2, read_state_after=2, optimizer=LION)
    assert overlapped[0] == serial[0]
    for name, value in serial[1].items():
        assert torch.equal(overlapped[1][name], value), name
    early_serial, early_overlapped = serial[2]["state"], overlapped[2]["state"]
    assert early_serial.keys() == early_overlapped.keys() and early_serial
    for key, entry in early_serial.items():
        assert torch.equal(early_overlapped[key]["exp_avg"], entry["exp_avg"]), key


def test_step_returns_before_the_cpu_work_and_the_next_forward_settles_it():
    model, _ = make_models()
    with gx.enable(model, _config("sim", "fp32", overlap=True)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        gm = engine.internal.runtime
        host_sets = sum(1 for p in gm.set_placements() if p["trainable"] and p["optim_on_host"])
        assert host_sets >= 10, "the small GPT spans many chunk sets with the optimizer on the host"
        x, y = batch(model.cfg, 0, engine.compute_device)
        gm.hold_optimizer_thread(True)  # the CPU steps (started during backward) cannot run: step() must not wait
        try:
            model(x, y).backward()
            opt.step()
            assert gm.pending_steps() == host_sets
            assert opt.last_step_stats()["pending_sets"] == host_sets
            opt.zero_grad()  # clears the gradient books only: does not wait either
            assert gm.pending_steps() == host_sets
        finally:
            gm.hold_optimizer_thread(False)
        x, y = batch(model.cfg, 1, engine.compute_device)
        loss = model(x, y)
        assert gm.pending_steps() == 0, "forward settled every set on its way"
        stats = opt.last_step_stats()  # before the next backward, whose own steps start the clocks again
        assert stats["host_params"] > 0 and stats["host_seconds"] > 0
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_serial_mode_settles_before_step_returns():
    model, _ = make_models()
    with gx.enable(model, _config("sim", "fp32", overlap=False)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        x, y = batch(model.cfg, 0, engine.compute_device)
        model(x, y).backward()
        opt.step()
        assert engine.internal.runtime.pending_steps() == 0
        assert opt.last_step_stats()["pending_sets"] == 0


def test_overlap_optimizer_must_be_a_bool():
    with pytest.raises(ValueError, match=r"overlap_optimizer: expected True or False, got 'yes'"):
        gx.GeminiConfig(device="sim", overlap_optimizer="yes")


def _train_lanes(device, case, link_every, steps=4):
    """Trains with every `link_every`-th host set on the link lane (0: none); returns the losses,
    the final parameters and the last step's stats."""
    model, _ = make_models()
    losses = []
    with gx.enable(model, _config(device, case, overlap=True)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        host_sets = host_sets_with_link_lane(engine, link_every)
        for step in range(steps):
            x, y = batch(model.cfg, step, engine.compute_device)
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        last = opt.last_step_stats()
    params = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    return losses, params, last, len(host_sets)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["bf16_clipping", "split_clipping"])  # no speculation: steps at step()
def test_the_link_lane_steps_host_state_to_the_same_bits(device, case):
    """Host sets stepped by the device's kernel over the link (beside the CPU stepping the
    others) end in the same parameters as the CPU stepping them all."""
    cpu_losses, cpu_params, cpu_last, host_sets = _train_lanes(device, case, link_every=0)
    losses, params, last, _ = _train_lanes(device, case, link_every=2)
    assert host_sets >= 2, "the case is meant to keep several sets' state on the host"
    assert cpu_last["link_params"] == 0 and last["link_params"] > 0 and last["host_params"] > 0, last
    assert last["link_params"] + last["host_params"] == cpu_last["host_params"]
    assert losses == cpu_losses
    for name, value in cpu_params.items():
        assert torch.equal(params[name], value), name


@pytest.mark.parametrize("device", DEVICES)
def test_room_for_some_sets_spares_speculates_those_and_stays_exact(device, monkeypatch):
    """A host with room for the spares of a few chunk sets only: those whose gradients reach the
    host first speculate, the others step at step(); the spares held stay within the room, and
    the result is the serial step's bit for bit."""
    from gemini_ext.optim import wrapper
    set_spare_bytes = 2 * CHUNK_BYTES_FP32  # Lion, fp32: the parameter (its own master) and m
    room = 2 * 4 * set_spare_bytes  # half of it for spares: about four sets' worth
    monkeypatch.setattr(wrapper, "host_available_bytes", lambda ranks=1: room)
    serial = _train(device, "fp32", overlap=False, optimizer=LION)
    partial = _train(device, "fp32", overlap=True, optimizer=LION)
    assert partial[0] == serial[0]
    for name, value in serial[1].items():
        assert torch.equal(partial[1][name], value), name
    spec = partial[4]
    assert spec["confirmed"] > 0 and 0 < spec["spare_bytes"] <= room, spec
    model, _ = make_models()
    with gx.enable(model, _config(device, "fp32", True)) as engine:
        host_sets = sum(1 for p in engine.internal.runtime.set_placements() if p["trainable"] and p["optim_on_host"])
    assert spec["spare_bytes"] < host_sets * set_spare_bytes, "room for some sets' spares, not every set's"
    assert spec["confirmed"] < host_sets * 6, "the others stepped at step()"


def test_stats_say_where_the_host_steps_started_and_why(monkeypatch):
    """stats()["placement"]["host_steps"]: every set during backward where the spares fit or
    under optimizer_step_in_backward, some where they fit for some sets, none under clipping
    that triggers, each with its reason."""
    from gemini_ext.optim import wrapper

    def host_steps(cfg, room=1 << 40, optimizer=LION):
        monkeypatch.setattr(wrapper, "host_available_bytes", lambda ranks=1: room)
        model, _ = make_models()
        with gx.enable(model, cfg) as engine:
            opt = engine.optimizer(optimizer, lr=LR, weight_decay=WD)
            for step in range(2):
                x, y = batch(model.cfg, step, engine.compute_device)
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
            return engine.stats()["placement"]["host_steps"]

    assert host_steps(_config("sim", "fp32", True)) == {
        "during_backward": "every set", "why": "speculation: the host holds every host set's spares"}
    some = host_steps(_config("sim", "fp32", True), room=2 * 4 * 2 * CHUNK_BYTES_FP32)
    assert some["during_backward"] == "some sets" and "the others at step()" in some["why"], some
    clipped = host_steps(_config("sim", "bf16_clipping", True))
    assert clipped["during_backward"] == "none" and "max_norm=0.05" in clipped["why"], clipped
    guessed = host_steps(_config("sim", "fp32", True), optimizer=ADAMW)
    assert guessed == {"during_backward": "every set", "why": "speculation: the last step was not clipped"}, guessed
    guess_clipped = host_steps(_config("sim", "bf16_clipping", True), optimizer=ADAMW)
    assert guess_clipped["during_backward"] == "none" and "clipped" in guess_clipped["why"], guess_clipped
    in_place = host_steps(gx.GeminiConfig(device="sim", precision="fp32", chunk_config_dict=CHUNK,
                                          optimizer_step_in_backward=True), optimizer=ADAMW)
    assert in_place["during_backward"] == "every set" and "optimizer_step_in_backward" in in_place["why"], in_place


def test_spares_do_not_creep_and_grow_only_to_cover_every_host_set(monkeypatch):
    """Once spares are held, a host whose free memory varies does not get more step after step:
    more are taken only when they cover every host set at once."""
    from gemini_ext.optim import wrapper
    room = [2 * 4 * 2 * CHUNK_BYTES_FP32]  # the first spares (Lion: master and m): about four sets' worth
    monkeypatch.setattr(wrapper, "host_available_bytes", lambda ranks=1: room[0])
    model, _ = make_models()
    held, cover = [], []
    with gx.enable(model, _config("sim", "fp32", True)) as engine:
        opt = engine.optimizer(LION, lr=LR, weight_decay=WD)
        for step in range(6):
            if step == 3:
                room[0] += room[0] // 2  # some more free memory: not enough to cover every set
            if step == 4:
                room[0] = 1 << 40
            x, y = batch(model.cfg, step, engine.compute_device)
            model(x, y).backward()
            cover.append(engine.stats()["placement"]["host_steps"]["during_backward"])
            opt.step()
            opt.zero_grad()
            held.append(opt.speculation_stats()["spare_bytes"])
    assert cover[:4] == ["some sets"] * 4 and cover[4:] == ["every set"] * 2, cover
    assert held[0] > 0 and held[:4] == [held[0]] * 4, held
    assert held[4] > held[3] and held[5] == held[4], held
