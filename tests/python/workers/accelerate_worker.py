"""Run by test_integration_accelerate under `accelerate launch --multi_gpu --num_processes 2` on
a machine without GPUs (Accelerator(cpu=True): two gloo ranks, MULTI_CPU): both
ranks run the same Accelerate loop twice, once plain (accelerate wraps the model in
DistributedDataParallel over gloo) and once under a gemini_ext engine sharded over the same
group, where the run stops half way, saves (accelerator.save_state plus the engine's checkpoint
beside it), and a fresh engine, Accelerator, optimizer and scheduler resume from that directory.
Rank 0 writes how far apart the two runs are to OUT/report.json."""

import copy
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/python: the shared helpers

import accelerate
import torch

import gemini_ext as gx
from gemini_ext.integrations.accelerate import prepare
from gemini_ext.models import GPT
from parity_utils import SMALL, batch, max_relative_difference

STEPS, ACCUM, MAX_NORM = 4, 2, 0.05


def _first(items):
    return items[0]


def _data():
    # one item per micro-batch; the prepared loader gives each rank every other one
    return torch.utils.data.DataLoader([batch(SMALL, k, torch.device("cpu")) for k in range(2 * STEPS * ACCUM)],
                                       batch_size=1, collate_fn=_first)


def _scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _train(accelerator, model, opt, loader, sched, micro_batches):
    norms = []
    for k, (x, y) in enumerate(loader):
        if k == micro_batches:
            break
        with accelerator.accumulate(model):
            accelerator.backward(model(x, y))
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
            opt.step()
            sched.step()
            opt.zero_grad()
    return norms


def _gemini_run(initial, out: Path, first_micro_batches: int):
    """The engine's run in two parts, with a save and a resume between them."""
    config = gx.GeminiConfig(device="sim", precision="fp32", chunk_config_dict={"chunk_size": 4096})
    norms, ckpt = [], out / "state"
    for part in (0, 1):
        model = copy.deepcopy(initial)
        with gx.enable(model, config) as engine:
            accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
            prepare(accelerator, engine)
            opt = engine.optimizer(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
            sched = _scheduler(opt)
            model, opt, loader, sched = accelerator.prepare(model, opt, _data(), sched)
            if part == 0:
                norms += _train(accelerator, model, opt, loader, sched, first_micro_batches)
                accelerator.save_state(str(ckpt))
                engine.save_checkpoint(str(ckpt / "gemini_ext"))
                world_size, steps_before = engine.world_size, engine.stats()["optimizer_steps"]
            else:
                accelerator.load_state(str(ckpt))
                engine.load_checkpoint(str(ckpt / "gemini_ext"))
                rest = accelerator.skip_first_batches(loader, first_micro_batches)
                norms += _train(accelerator, model, opt, rest, sched, 10 ** 6)
                steps_after = engine.stats()["optimizer_steps"]
                last_lr = sched.get_last_lr()[0]
    return model, norms, {"world_size": world_size, "steps_before": steps_before, "steps_after": steps_after,
                          "last_lr": last_lr}


def main(out: str) -> None:
    torch.set_num_threads(1)  # the two ranks share the machine's cores
    root = Path(out)
    torch.manual_seed(0)
    initial = GPT(SMALL)
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    reference = copy.deepcopy(initial)
    opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1)
    sched = _scheduler(opt)
    wrapped, opt, loader, sched = accelerator.prepare(reference, opt, _data(), sched)
    plain_norms = _train(accelerator, wrapped, opt, loader, sched, 10 ** 6)
    plain_lr = sched.get_last_lr()[0]
    model, norms, facts = _gemini_run(initial, root, first_micro_batches=STEPS * ACCUM // 2)
    if accelerator.process_index != 0:
        return
    report = {"num_processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
              "plain_norms": plain_norms, "norms": norms, "plain_lr": plain_lr,
              "difference": max(max_relative_difference(model, reference).values()), **facts}
    (root / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
