"""engine.state_dict() into a plain model; save_checkpoint / load_checkpoint resume bit-exactly."""

import os

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from gemini_ext.models import GPT
from parity_utils import LR, SMALL, WD, batch, config, make_models, train_step


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_state_dict_round_trips_into_a_plain_model(precision):
    model, _ = make_models()
    keys = set(model.state_dict())
    with gx.enable(model, config("sim", precision=precision)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR)
        for step in range(3):
            train_step(model, opt, step, "cpu")
        sd = engine.state_dict()
        assert set(sd) == keys
        assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in sd.values() if v.is_floating_point())
        x, y = batch(model.cfg, 99, "cpu")
        with torch.no_grad():
            engine_loss = model(x, y).item()
    plain = GPT(SMALL)
    plain.load_state_dict(sd)
    for name, p in model.named_parameters():  # after close the model holds the same fp32 masters
        assert torch.equal(p.detach(), plain.state_dict()[name]), name
    with torch.no_grad():
        plain_loss = plain(x, y).item()
    assert plain_loss == pytest.approx(engine_loss, rel=1e-5 if precision == "fp32" else 2e-2)


def _train(model, engine, opt, steps, start):
    return [train_step(model, opt, step, engine.compute_device) for step in range(start, start + steps)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision,extra", [("fp32", {}), ("bf16", {"offload_optim_frac": 0.5}),
                                             ("fp16", {"max_norm": 1.0})])
def test_resume_from_a_checkpoint_continues_bit_exactly(tmp_path, device, precision, extra):
    cfg = config(device, precision=precision, **extra)
    model, _ = make_models()
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        uninterrupted = _train(model, engine, opt, 8, 0)
        final = engine.state_dict()

    model, _ = make_models()
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        first = _train(model, engine, opt, 4, 0)
        engine.save_checkpoint(tmp_path / "ckpt")
        scale = engine.internal.scaler.scale if engine.internal.scaler else None
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], "nothing left beside it"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["index.json", "rank00000-g1.pt"]

    model, _ = make_models(seed=123)  # different initial values: everything must come from the checkpoint
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        engine.load_checkpoint(tmp_path / "ckpt")
        if scale is not None:
            assert engine.internal.scaler.scale == scale
        rest = _train(model, engine, opt, 4, 4)
        resumed = engine.state_dict()
    assert first + rest == uninterrupted, "same losses as the uninterrupted run"
    for k in final:
        assert torch.equal(final[k], resumed[k]), k


def test_checkpoint_saves_are_atomic(tmp_path, monkeypatch):
    model, _ = make_models()
    with gx.enable(model, config("sim")) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR)
        _train(model, engine, opt, 1, 0)
        path = tmp_path / "ckpt"
        engine.save_checkpoint(path)
        good = (path / "rank00000-g1.pt").read_bytes()
        _train(model, engine, opt, 1, 1)

        def broken_save(*args, **kwargs):
            raise OSError("disk full")

        monkeypatch.setattr(torch, "save", broken_save)
        with pytest.raises(OSError, match="disk full"):
            engine.save_checkpoint(path)
        monkeypatch.undo()
        assert (path / "rank00000-g1.pt").read_bytes() == good, "the old checkpoint is intact"
        assert sorted(os.listdir(path)) == ["index.json", "rank00000-g1.pt"], "the failed save's file is gone"
        engine.save_checkpoint(path)  # overwriting an existing checkpoint works
        assert sorted(os.listdir(path)) == ["index.json", "rank00000-g2.pt"], "the previous generation removed"
        assert (path / "rank00000-g2.pt").read_bytes() != good


def test_checkpoint_errors_are_clear(tmp_path):
    model, _ = make_models()
    with gx.enable(model, config("sim")) as engine:
        with pytest.raises(FileNotFoundError, match="index.json"):
            engine.load_checkpoint(tmp_path / "missing")
        opt = engine.optimizer(torch.optim.AdamW, lr=LR)
        _train(model, engine, opt, 1, 0)
        engine.save_checkpoint(tmp_path / "ckpt")
    model, _ = make_models()
    with gx.enable(model, config("sim")) as engine:
        with pytest.raises(RuntimeError, match="create the optimizer"):
            engine.load_checkpoint(tmp_path / "ckpt")
    with gx.enable(GPT(SMALL), config("sim")) as engine:
        with pytest.raises(RuntimeError, match="missing keys"):
            engine.load_state_dict({"nope": torch.zeros(1)})


KILL_TRIALS = 40


def test_a_save_killed_at_any_moment_leaves_a_loadable_checkpoint(tmp_path):
    """SIGKILL at random moments of saves in a loop (tests/python/workers/checkpoint_kill_worker.py):
    after every kill the path holds a complete checkpoint, the previous one or the new one."""
    import json
    from conftest import run_python
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "checkpoint_kill_worker.py")
    # sim only, with no GPU visible: the children are forked, and CUDA does not survive fork()
    out = run_python(worker, str(tmp_path / "ckpt"), str(KILL_TRIALS), env={"OMP_NUM_THREADS": "1",
                     "CUDA_VISIBLE_DEVICES": "", "GEMINI_EXT_DEVICE": None}, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["trials"] == KILL_TRIALS and len(r["generations"]) == KILL_TRIALS
    assert len(set(r["generations"])) > KILL_TRIALS // 4, "the kills landed in many different saves"
    assert r["loaded_steps"] == r["steps"][-1] > 0
    # after every kill, beside the committed checkpoint: at most one killed save's rank file and
    # (killed between the index's write and its rename) its temporary index, however many in a row
    left = r["most_left_beside"]
    ranks, indexes = [n for n in left if n.startswith("rank")], [n for n in left if n.startswith("index")]
    assert len(ranks) <= 1 and len(indexes) <= 1 and len(left) == len(ranks) + len(indexes), \
        f"at most the files of one killed save beside the committed checkpoint: {left}"


def test_a_truncated_or_corrupted_file_is_refused_naming_it(tmp_path):
    model, _ = make_models()
    with gx.enable(model, config("sim")) as engine:
        engine.optimizer(torch.optim.AdamW, lr=LR)
        engine.save_checkpoint(tmp_path / "ckpt")
        file = tmp_path / "ckpt" / "rank00000-g1.pt"
        good = file.read_bytes()
        file.write_bytes(good[: len(good) // 2])
        with pytest.raises(ValueError, match="rank00000-g1.pt has .* bytes, its index recorded"):
            engine.load_checkpoint(tmp_path / "ckpt")
        flipped = bytearray(good)
        flipped[len(good) // 2] ^= 0xFF  # inside a tensor's bytes: only the checksum sees it
        file.write_bytes(bytes(flipped))
        with pytest.raises(ValueError, match="rank00000-g1.pt is corrupted"):
            engine.load_checkpoint(tmp_path / "ckpt")
        file.unlink()
        with pytest.raises(FileNotFoundError, match="rank00000-g1.pt is missing"):
            engine.load_checkpoint(tmp_path / "ckpt")
