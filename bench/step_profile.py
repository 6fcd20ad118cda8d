"""One training loop, two systems, nothing else: where a step's time goes when the model fits.

    python bench/step_profile.py plain  --preset 6.7b --batch 1   # fused AdamW, bf16 autocast
    python bench/step_profile.py gemini --preset 6.7b --batch 1   # gemini_ext auto, every chunk on the device

The model is built on the GPU. The loop clips at 1.0 in both systems. It prints three steps with
the device synchronised between forward, backward and the optimizer (each phase's own time), four
steps as a training loop runs them (synchronised only at the step's end), and torch.profiler's
tables (self CPU time, self CUDA time) over two more.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gemini_ext as gx  # noqa: E402
from gemini_ext.models import GPT, GPT_PRESETS, synthetic_batch  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("system", choices=["plain", "gemini"])
    p.add_argument("--preset", default="6.7b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024)
    args = p.parse_args(argv)
    cfg = GPT_PRESETS[args.preset]
    device = torch.device("cuda")
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    if args.system == "plain":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        engine = gx.enable(model, gx.GeminiConfig(placement_policy="auto", max_norm=1.0))
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-4)

    def loss_of(x, y):
        if args.system == "plain":
            with torch.autocast("cuda", torch.bfloat16):
                return model(x, y)
        return model(x, y)

    def optimizer_step():
        if args.system == "plain":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()  # the engine clips by max_norm
        opt.zero_grad(set_to_none=True)

    def phased(x, y):
        a = time.perf_counter()
        loss = loss_of(x, y)
        torch.cuda.synchronize()
        b = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        c = time.perf_counter()
        optimizer_step()
        return b - a, c - b

    def free(x, y):
        loss_of(x, y).backward()
        optimizer_step()
        return ()

    def timed(step, n):
        out = []
        for i in range(n):
            x, y = synthetic_batch(cfg, args.batch, args.seq, i, device, seed=0)
            torch.cuda.synchronize()
            start = time.perf_counter()
            parts = step(x, y)
            torch.cuda.synchronize()
            out.append((time.perf_counter() - start, *parts))
        return out

    for total, forward, backward in timed(phased, 5)[2:]:
        print(f"{args.system}: step {total * 1e3:.1f} ms (synchronised phases) forward {forward * 1e3:.1f} "
              f"backward {backward * 1e3:.1f}")
    print(args.system, "steps ms", [round(t[0] * 1e3, 1) for t in timed(free, 4)])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed(free, 2)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
