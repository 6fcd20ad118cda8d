"""A user's own Accelerate loop under the engine (gemini_ext.integrations.accelerate.prepare):
the optimizer, data loader and scheduler prepared by the Accelerator, gradient accumulation and
clipping through it, against the same loop without gemini_ext."""

import copy

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from parity_utils import SMALL, batch, chunk_cap, max_relative_difference
from gemini_ext.models import GPT

accelerate = pytest.importorskip("accelerate")
from gemini_ext.integrations.accelerate import prepare  # noqa: E402

STEPS, ACCUM = 4, 2


def _loop(accelerator, model, opt, sched):
    data = [batch(SMALL, k, torch.device("cpu")) for k in range(STEPS * ACCUM)]
    model, opt, loader, sched = accelerator.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=None),
                                                    sched)
    norms = []
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(x, y))
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.05)))
            opt.step()
            sched.step()
            opt.zero_grad()
    return norms


@pytest.mark.parametrize("device", DEVICES)
def test_an_accelerate_loop_trains_as_without_gemini_ext(device):
    torch.manual_seed(0)
    model = GPT(SMALL)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1)
    cpu = device != "cuda"
    plain_norms = _loop(accelerate.Accelerator(cpu=cpu, gradient_accumulation_steps=ACCUM), reference, ref_opt,
                        torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5))
    config = gx.GeminiConfig(device=device, precision="fp32", chunk_config_dict={"chunk_size": 4096},
                             **chunk_cap(device, 8 * 4096 * 4))
    with gx.enable(model, config) as engine:
        accelerator = accelerate.Accelerator(cpu=cpu, gradient_accumulation_steps=ACCUM)
        prepare(accelerator, engine)
        opt = engine.optimizer(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
        norms = _loop(accelerator, model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
        assert engine.stats()["optimizer_steps"] == STEPS
        assert engine.stats()["counters"]["evictions"] > 0, "the budget evicts"
        # told the accumulation when the optimizer was prepared: no host step started in a backward that
        # the next one adds to (its undo, within ulps, would feed the next forward perturbed parameters)
        assert engine.stats()["speculation"]["guesses_undone"] == 0, engine.stats()["speculation"]
    assert norms == pytest.approx(plain_norms, rel=1e-4) and min(plain_norms) > 0.05, "clipped, in the chunks"
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


def test_without_prepare_the_accelerators_clipping_still_clips_in_the_chunks():
    """accelerate's clip_grad_norm_ reads p.grad, which is None for managed parameters: without
    prepare() it would report 0 and clip nothing. While an engine is open it clips through the
    engine, and a mix of managed and other parameters raises."""
    torch.manual_seed(0)
    model = GPT(SMALL)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1)
    plain_norms = _loop(accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUM), reference, ref_opt,
                        torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5))
    config = gx.GeminiConfig(device="sim", precision="fp32", chunk_config_dict={"chunk_size": 4096})
    with gx.enable(model, config) as engine:
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
        opt = engine.optimizer(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
        norms = _loop(accelerator, model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
        with pytest.raises(RuntimeError, match="engine.clip_grad_norm_"):
            accelerator.clip_grad_norm_([*model.parameters(), torch.nn.Parameter(torch.ones(2))], 1.0)
    assert norms == pytest.approx(plain_norms, rel=1e-4) and min(plain_norms) > 0.05, "clipped, in the chunks"
    assert max(max_relative_difference(model, reference).values()) <= 1e-5
    assert accelerate.Accelerator.clip_grad_norm_.__module__.startswith("accelerate"), "put back at close"


def test_prepare_refuses_what_is_not_an_open_engine():
    with pytest.raises(ValueError, match="must be an open engine"):
        prepare(accelerate.Accelerator(cpu=True), object())


def test_two_processes_under_accelerate_launch_train_save_and_resume_as_without_gemini_ext(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` with Accelerator(cpu=True): the loop above
    at two gloo ranks, plain
    (DistributedDataParallel) against the engine sharded over the same group, which stops half
    way, saves (accelerator.save_state and engine.save_checkpoint) and resumes in a fresh engine."""
    import json
    import os
    from conftest import run_python
    from dist_utils import free_port
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "accelerate_worker.py")
    out = run_python("-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                     "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
                     worker, str(tmp_path), env={"OMP_NUM_THREADS": "1", "ACCELERATE_CONFIG_FILE": None},
                     timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    r = json.loads((tmp_path / "report.json").read_text())
    assert r["num_processes"] == 2 and r["world_size"] == 2 and r["distributed_type"].endswith("MULTI_CPU"), r
    assert (r["steps_before"], r["steps_after"]) == (STEPS // 2, STEPS), "the step count resumes from the checkpoint"
    assert len(r["norms"]) == len(r["plain_norms"]) == STEPS and r["norms"] == pytest.approx(r["plain_norms"], rel=1e-4)
    assert r["last_lr"] == r["plain_lr"] < 3e-3, "the scheduler resumed from save_state"
    assert r["difference"] <= 5e-5, r  # a per-rank mean of means: another summation order (test_distributed)
    assert len(list((tmp_path / "state" / "gemini_ext").iterdir())) >= 2, "each rank wrote its shard"
