"""In-place speculation: each host set's AdamW step taken during backward, guessing a gradient
multiplier of 1, then confirmed, corrected (clipping) or undone at step() (the Note in
csrc/torch/optim/hybrid_optimizer_in_place.cpp).

Two engines train the same model in lockstep, one speculating (overlap_optimizer=True, the
default) and one stepping serially (overlap_optimizer=False); before every step the serial one
takes the speculating one's parameters and optimizer state, so each step is compared from the
same state: bit for bit where the guess held (the norm within max_norm, or no clipping), within
4 ulps of the parameters (relative 1e-6) where it was corrected or undone. The losses of the
speculating run stay within the plain PyTorch run's (torch's clip_grad_norm_ and AdamW) parity
tolerance. On `sim` in CI, on cuda on the GPU machine.
"""

import math
import warnings

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from parity_utils import CHUNK, LR, WD, batch, host_sets_with_link_lane, make_models, torch_device

PARAM_RTOL, PARAM_ATOL = 1e-6, 1e-9


def _config(device, overlap, max_norm):
    return gx.GeminiConfig(device=device, precision="fp32", chunk_config_dict=CHUNK, overlap_optimizer=overlap,
                           max_norm=max_norm)


def _unscaled_norm(model, device) -> float:
    """The gradient norm of batch 0 in plain PyTorch (max_norm is set from it)."""
    model = model.to(torch_device(device))
    x, y = batch(model.cfg, 0, torch_device(device))
    model(x, y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    model.zero_grad()
    return norm


class Lockstep:
    """A speculating engine and a serial one on copies of one model."""

    def __init__(self, device, max_norm, link_every=0):
        (self.model, self.serial_model), self.device = make_models(), device
        self.spec_engine = gx.enable(self.model, _config(device, True, max_norm))
        self.serial_engine = gx.enable(self.serial_model, _config(device, False, max_norm))
        self.opt = self.spec_engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        self.serial_opt = self.serial_engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        for engine in (self.spec_engine, self.serial_engine):  # every link_every-th host set on the link lane
            host_sets_with_link_lane(engine, link_every)
        # Where the first iteration's end decides the placement (static on cuda plans for the
        # activations it measured), that iteration steps at step(): the guesses start with the second.
        self.first_guessed = 0 if not self.spec_engine.internal.placer.decides_at_iteration_end() else 1

    def close(self):
        self.spec_engine.close()
        self.serial_engine.close()

    def step(self, step, factor=1.0, micro_batches=1, no_sync=False, grad_hook=None, before_step=None):
        """Syncs the serial side, then one step on both; returns the speculating side's last step."""
        self.serial_model.load_state_dict(self.model.state_dict())
        self.serial_opt.load_state_dict(self.opt.state_dict())
        for model, engine, opt in ((self.model, self.spec_engine, self.opt),
                                   (self.serial_model, self.serial_engine, self.serial_opt)):
            handles = [grad_hook(model)] if grad_hook is not None else []
            for micro in range(micro_batches):
                x, y = batch(model.cfg, step * micro_batches + micro, engine.compute_device)
                quiet = no_sync and micro < micro_batches - 1
                with engine.no_sync() if quiet else _nothing():
                    (model(x, y) * (factor / micro_batches)).backward()
            for h in handles:
                h.remove()
            if before_step is not None:
                before_step(opt)
            opt.step()
        last = self.opt.last_step_stats()
        return last

    def state(self, model, opt):
        sd = opt.state_dict()["state"]
        moments = {(k, f): v[f] for k, v in sd.items() for f in ("exp_avg", "exp_avg_sq")}
        return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}, moments

    def compare(self, exact: bool, what: str, param_atol: float = PARAM_ATOL):
        params, moments = self.state(self.model, self.opt)
        ref_params, ref_moments = self.state(self.serial_model, self.serial_opt)
        for name, ref in ref_params.items():
            if exact:
                torch.testing.assert_close(params[name], ref, rtol=0, atol=0, equal_nan=True, msg=f"{what}: {name}")
            else:
                torch.testing.assert_close(params[name], ref, rtol=PARAM_RTOL, atol=param_atol, equal_nan=True,
                                           msg=f"{what}: {name}")
        for key, ref in ref_moments.items():
            if exact:
                torch.testing.assert_close(moments[key], ref, rtol=0, atol=0, equal_nan=True, msg=f"{what}: {key}")
            else:  # the rounding of the speculated m' and v', which the correction cannot take back: a few ulps
                # of those, which exceed the corrected moments where the clipped gradient was a spike
                # (here 16 times the steps before, early in training: v' up to 10 times v'')
                finite = ref[torch.isfinite(ref)]
                scale = finite.abs().max().item() if finite.numel() else 0.0
                torch.testing.assert_close(moments[key], ref, rtol=1e-6, atol=1e-5 * scale, equal_nan=True,
                                           msg=f"{what}: {key}")

    def zero_grad(self):
        self.opt.zero_grad()
        self.serial_opt.zero_grad()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("device", DEVICES)
def test_fifty_steps_crossing_max_norm_both_ways(device):
    """Norms within max_norm, and above it every third step: the guesses that held are the serial
    step's bits, the corrected ones within 4 ulps; and the run tracks torch's clip + AdamW."""
    max_norm = _unscaled_norm(make_models()[0], device)
    factors = [0.25 if k % 3 != 2 else 4.0 for k in range(50)]
    run = Lockstep(device, max_norm)
    held = corrected = 0
    try:
        for k, factor in enumerate(factors):
            last = run.step(k, factor)
            clipped = run.opt.last_grad_norm > max_norm
            assert clipped == (factor > 1.0), (k, run.opt.last_grad_norm, max_norm)
            run.compare(exact=not clipped, what=f"step {k} ({'clipped' if clipped else 'within max_norm'})")
            held += last["guessed_sets"] > 0 and not clipped
            corrected += last["corrected_sets"] > 0
            if clipped and k > 0 and factors[k - 1] < 1.0:
                assert last["corrected_sets"] == last["guessed_sets"] > 0, (k, last)
            run.zero_grad()
        summary = run.spec_engine.stats()["speculation"]
    finally:
        run.close()
    assert held == 18 - run.first_guessed and corrected == 16, (held, corrected)  # none after a clipped step
    assert summary["steps"] == 50 and summary["clip_fraction"] == pytest.approx(16 / 50), summary
    assert summary["spare_bytes"] == 0, "in place: no spare copies"


@pytest.mark.parametrize("device", DEVICES)
def test_the_link_lane_guesses_beside_the_cpu_with_the_serial_steps_bits(device):
    """Every other host set on the link lane (the device's kernel over the host state): those
    guess during backward on their lane as the CPU's sets do on theirs; confirmed, the bits are the
    serial step's (the link lane's kernel at step()); clipped, corrected within 4 ulps."""
    max_norm = _unscaled_norm(make_models()[0], device)
    run = Lockstep(device, max_norm, link_every=2)
    try:
        factors = [0.25, 0.25, 4.0, 0.25, 0.25]
        for k, factor in enumerate(factors):
            last = run.step(k, factor)
            clipped = factor > 1.0
            run.compare(exact=not clipped, what=f"step {k}")
            assert last["link_params"] > 0 and last["host_params"] > 0, (k, last)
            if k >= run.first_guessed and (k == 0 or factors[k - 1] < 1.0):  # none after a clipped step
                assert last["guessed_sets"] == run.spec_engine.stats()["placement"]["optim_chunks_on_host"], (k, last)
                assert last["corrected_sets"] == (last["guessed_sets"] if clipped else 0), (k, last)
            run.zero_grad()
        seconds = run.spec_engine.stats()["lanes"]["busy_seconds"]
    finally:
        run.close()
    assert seconds["link"] > 0 and seconds["cpu"] > 0, seconds


@pytest.mark.parametrize("device", DEVICES)
def test_the_run_tracks_torch_clip_and_adamw(device):
    """Against plain PyTorch (clip_grad_norm_ then AdamW) with steps that clip and steps that do
    not: the losses agree as the engine's serial step's do (fp32 on both sides)."""
    model, reference = make_models()
    max_norm = _unscaled_norm(make_models()[0], device)
    factors = [0.25, 0.25, 4.0, 0.25, 0.25, 4.0]
    dev = torch_device(device)
    reference.to(dev)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    ref_losses, losses = [], []
    for k, f in enumerate(factors):
        x, y = batch(reference.cfg, k, dev)
        loss = reference(x, y)
        (loss * f).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    with gx.enable(model, _config(device, True, max_norm)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        for k, f in enumerate(factors):
            x, y = batch(model.cfg, k, engine.compute_device)
            loss = model(x, y)
            (loss * f).backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert engine.stats()["speculation"]["steps_clipped"] == 2
    assert losses == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("no_sync", [False, True], ids=["plain", "no_sync"])
def test_gradient_accumulation_speculates_on_the_last_backward(device, no_sync):
    """Four micro-batches per step. Plain backwards: the first step guesses after each backward
    and undoes it when the next adds to the gradients (within 4 ulps); from then on only the
    fourth speculates and the steps are the serial one's bits. Under no_sync the gradients reach
    the host with the last backward only: exact from the first step."""
    run = Lockstep(device, max_norm=0.0)
    try:
        for k in range(4):
            last = run.step(k, micro_batches=4, no_sync=no_sync)
            run.compare(exact=k > 0 or no_sync, what=f"step {k}")
            assert (last["guessed_sets"] > 0) == (k >= run.first_guessed) and last["corrected_sets"] == 0, (k, last)
            run.zero_grad()
        counts = run.opt.speculation_stats()["in_place"]
        first_guessed = run.first_guessed
    finally:
        run.close()
    assert counts["backwards_per_step"] == 4
    # undone: the first step's guesses after each plain backward, where that step guessed at all
    assert (counts["undone"] > 0) == (not no_sync and first_guessed == 0), counts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clipping", [False, True], ids=["no_clipping", "clipping"])
def test_a_non_finite_gradient_is_not_speculated(device, clipping):
    """An inf in one parameter's gradient: its set's task writes nothing and the set steps as the
    serial step does (the same infs and NaNs); the others are confirmed, or corrected to the
    clipping coefficient of an infinite norm (0)."""
    def poison(model):
        return model.blocks[0].fc1.weight.register_hook(lambda g: torch.full_like(g, math.inf))

    max_norm = 2 * _unscaled_norm(make_models()[0], device) if clipping else 0.0
    run = Lockstep(device, max_norm=max_norm)
    try:
        for k in range(2):
            run.step(k)  # within max_norm
            run.compare(exact=True, what=f"step {k}")
            run.zero_grad()
        last = run.step(2, grad_hook=poison)
        # Clipping an infinite norm gives a coefficient of 0: where this step's gradient dominated v'
        # (embedding rows whose tokens were rare so far), the correction keeps 2^-25 v'/v'' of the
        # update (adam_correction.h), unbounded in principle: within a hundredth of a learning rate here.
        run.compare(exact=not clipping, what="the step with an inf gradient", param_atol=1e-2 * LR)
        assert last["skipped_sets"] >= 1 and last["guessed_sets"] > last["skipped_sets"], last
        assert not torch.isfinite(run.model.blocks[0].fc1.weight.detach()).all()
    finally:
        run.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpoint_right_after_a_corrected_step_resumes_bit_exactly(device, tmp_path):
    max_norm = _unscaled_norm(make_models()[0], device)
    factors = [0.25, 0.25, 4.0, 0.25, 0.25, 0.25]

    def run_steps(model, engine, opt, ks):
        for k in ks:
            x, y = batch(model.cfg, k, engine.compute_device)
            (model(x, y) * factors[k]).backward()
            opt.step()
            if k == 2:
                assert opt.last_step_stats()["corrected_sets"] > 0, "the step the checkpoint follows was corrected"
                engine.save_checkpoint(str(tmp_path / "ckpt"))  # its corrections may still be running
            opt.zero_grad()

    model, _ = make_models()
    with gx.enable(model, _config(device, True, max_norm)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        run_steps(model, engine, opt, range(6))
        engine.synchronize()  # the last step's host sets may still be stepping (overlap_optimizer)
        expected = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    resumed, _ = make_models(seed=1)
    with gx.enable(resumed, _config(device, True, max_norm)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        run_steps(resumed, engine, opt, range(3, 6))
        engine.synchronize()
        got = {n: p.detach().cpu().clone() for n, p in resumed.named_parameters()}
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_lr_changed_between_backward_and_step_is_undone_and_redone():
    """A scheduler stepped before optimizer.step(): the guessed hyperparameters were the old ones,
    so the step is undone and taken again with the new (within 4 ulps), and the next backward,
    whose hyperparameters hold, is exact again."""
    def halve_lr(opt):
        for g in opt.param_groups:
            g["lr"] *= 0.5

    run = Lockstep("sim", max_norm=0.0)
    try:
        for k in range(3):
            last = run.step(k, before_step=halve_lr if k == 1 else None)
            run.compare(exact=k != 1, what=f"step {k}")
            assert (last["redone_sets"] > 0) == (k == 1), (k, last)
            run.zero_grad()
    finally:
        run.close()


def test_host_step_speculation_chooses_the_guess_and_is_checked():
    """GeminiConfig(host_step_speculation=...): "in_place" guesses in place, "spares" with spare
    copies, "off" not at all; every one trains to the serial step's bits (no clipping)."""
    from parity_utils import LR, WD, batch, config, make_models

    def run(mode):
        model, _ = make_models()
        with gx.enable(model, config("sim", host_step_speculation=mode, offload_optim_frac=1.0)) as engine:
            opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
            for k in range(3):
                x, y = batch(model.cfg, k, engine.compute_device)
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
            engine.synchronize()
            summary = engine.stats()["speculation"]
            return {n: p.detach().clone() for n, p in model.named_parameters()}, summary, engine.stats()["placement"]

    results = {mode: run(mode) for mode in ("in_place", "spares", "off")}
    for mode in ("spares", "off"):
        assert all(torch.equal(results[mode][0][n], v) for n, v in results["in_place"][0].items()), mode
    in_place, spares, off = (results[m][1] for m in ("in_place", "spares", "off"))
    assert in_place["last_step"]["guessed_sets"] > 0 and in_place["spare_bytes"] == 0, in_place
    assert in_place["last_step"]["form"] == "in_place", in_place
    assert spares["last_step"]["guessed_sets"] > 0 and spares["spare_bytes"] > 0, spares
    assert spares["last_step"]["form"] == "spares" and spares["last_step"]["held"], spares
    assert off["last_step"]["guessed_sets"] == 0 and off["spare_bytes"] == 0 and off["last_step"]["form"] is None, off
    assert results["off"][2]["host_steps"] == {"during_backward": "none",
                                               "why": "host_step_speculation='off': every host set steps at step()"}
    with pytest.raises(ValueError, match="host_step_speculation: expected one of"):
        gx.GeminiConfig(host_step_speculation="yes")


@pytest.mark.parametrize("device", DEVICES)
def test_a_read_between_backward_and_step_sees_the_values_before_it_and_changes_nothing(device):
    """[Note: reading a guessed set]: the model's, the optimizer's and the engine's state dicts read
    between backward and step() keep the guesses (the run ends with the bits of a run without the
    reads) and show the values before the step: within the undo's rounding of the exact values that
    a run without speculation reads there (the same trajectory: no clipping, every guess holds)."""
    from parity_utils import config

    def run(mode, read):
        model, _ = make_models()
        with warnings.catch_warnings(record=True) as caught, \
                gx.enable(model, config(device, precision="bf16", host_step_speculation=mode)) as engine:
            warnings.simplefilter("always")
            opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
            seen = []
            for k in range(3):
                x, y = batch(model.cfg, k, engine.compute_device)
                model(x, y).backward()
                if read:
                    moments = {(i, f): v[f].clone() for i, v in opt.state_dict()["state"].items()
                               for f in ("exp_avg", "exp_avg_sq")}
                    seen.append(({n: v.float().cpu().clone() for n, v in model.state_dict().items()}, moments,
                                 engine.state_dict()))
                opt.step()
                opt.zero_grad()
            summary = engine.stats()["speculation"]
        said = [str(w.message) for w in caught if "host_step_speculation='spares'" in str(w.message)]
        return {n: p.detach().clone() for n, p in model.named_parameters()}, seen, {**summary, "said": said}

    without, read, exact = run("in_place", False), run("in_place", True), run("off", True)
    assert all(torch.equal(read[0][n], p) for n, p in without[0].items()), "a read changed the step"
    assert read[2]["guesses_undone"] == 0 and read[2]["reads_before_guesses"] > 0, read[2]
    assert without[2]["reads_before_guesses"] == 0 and exact[2]["reads_before_guesses"] == 0
    assert len(read[2]["said"]) == 1 and not exact[2]["said"], "the first such read says so, once"
    for k, ((params, moments, state), (ref_params, ref_moments, ref_state)) in enumerate(zip(read[1], exact[1])):
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=f"{k} {name}")
        for name, ref in ref_state.items():
            torch.testing.assert_close(state[name], ref, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=f"{k} {name}")
        for key, ref in ref_moments.items():  # v' - (1 - b2) g^2: a few ulps of v', not of v
            scale = ref.abs().max().item()
            torch.testing.assert_close(moments[key], ref, rtol=1e-6, atol=1e-6 * scale, msg=f"{k} {key}")


@pytest.mark.parametrize("form", ["in_place", "spares", "sgd", "in_backward"])
def test_the_host_sets_started_during_backward_are_counted_once_whatever_the_form(form):
    """stats()["speculation"]["last_step"] counts the host sets whose step started during backward in
    every form (in place, spares, SGD's spares, the step in backward), and that count is the one the
    placement's `host_steps` speaks of: every host set."""
    from parity_utils import config

    model, _ = make_models()
    fields = {"in_place": {}, "spares": {"host_step_speculation": "spares"}, "sgd": {},
              "in_backward": {"optimizer_step_in_backward": True}}[form]
    with gx.enable(model, config("sim", **fields)) as engine:
        opt = engine.optimizer(torch.optim.SGD if form == "sgd" else torch.optim.AdamW, lr=LR)
        for k in range(3):
            x, y = batch(model.cfg, k, engine.compute_device)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        stats = engine.stats()
    last = stats["speculation"]["last_step"]
    assert stats["placement"]["host_steps"]["during_backward"] == "every set", stats["placement"]["host_steps"]
    assert last["guessed_sets"] == stats["placement"]["optim_chunks_on_host"] > 0, (last, stats["placement"])
    assert last["form"] == {"sgd": "spares"}.get(form, form) and last["held"], last
