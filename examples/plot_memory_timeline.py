"""Trains a few steps under a device budget and plots the scheduler's memory timeline.
Needs matplotlib: `pip install ".[plot]"` (or `pip install matplotlib`).

    python examples/plot_memory_timeline.py --out timeline.png            # sim, gpt-tiny
    python examples/plot_memory_timeline.py --preset 1.3b --budget 8GiB   # on the GPU

The plot shows, over the last iteration, the chunk bytes on the device after every scheduling
event, the budget, and the events themselves: fetches for compute (F), prefetches (P) and
evictions (E). The JSON next to it (`--json`) holds the same timeline and per-step figures.
"""

from __future__ import annotations

import argparse
import json

try:
    import matplotlib
except ImportError:
    raise SystemExit("plot_memory_timeline.py needs matplotlib: pip install \".[plot]\" (gemini_ext's plot extra) "
                     "or pip install matplotlib.") from None

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import gemini_ext as gx  # noqa: E402
from gemini_ext.models import GPT, GPT_PRESETS, synthetic_batch  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(GPT_PRESETS), default="tiny")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--device", choices=["auto", "cuda", "sim"], default="auto")
    p.add_argument("--policy", choices=["static", "const", "auto"], default="const")
    p.add_argument("--budget", default=None,
                   help="const_gpu_budget, or the device limit for the other policies (default for const: half "
                        "the bf16 parameter bytes, at least six chunks)")
    p.add_argument("--chunks", type=int, default=16, help="about how many parameter chunks to cut the model into")
    p.add_argument("--out", default="memory_timeline.png")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg_model = GPT_PRESETS[args.preset]
    torch.manual_seed(0)
    model = GPT(cfg_model)
    model_m = cfg_model.num_parameters() / 2**20
    fields = dict(device=args.device, precision="bf16", placement_policy=args.policy,
                  min_chunk_size_m=min(32.0, model_m / args.chunks), search_range_m=min(64.0,
                                                                                        model_m / args.chunks / 2))
    if args.policy == "const":
        # default: half the bf16 parameter bytes, but room for six chunks and three of the largest tensor
        chunk = gx.search_chunk_configuration(model, fields["search_range_m"], fields["min_chunk_size_m"],
                                              precision="bf16")["chunk_size"]
        fields["const_gpu_budget"] = args.budget or max(int(cfg_model.num_parameters() * 2 * 0.5), 6 * chunk * 2,
                                                      3 * max(p.numel() for p in model.parameters()) * 2)
    elif args.budget:
        fields["gpu_memory_limit" if gx.resolve_device(gx.GeminiConfig(device=args.device)) == "cuda"
               else "sim_capacity"] = args.budget
    with gx.enable(model, gx.GeminiConfig(**fields)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=3e-4)
        for step in range(args.steps):
            x, y = synthetic_batch(cfg_model, args.batch, args.seq, step, engine.compute_device)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        timeline = engine.memory_timeline()
    events = timeline["events"]
    ends = [i for i, e in enumerate(events) if e["kind"] == "S"]
    last = events[ends[-2] + 1:ends[-1]] if len(ends) >= 2 else events
    t0 = last[0]["t"] if last else 0.0
    fig, ax = plt.subplots(figsize=(10, 4))
    ts = [(e["t"] - t0) * 1e3 for e in last]
    ax.step(ts, [e["device_bytes"] / 2**20 for e in last], where="post", label="chunk bytes on the device")
    ax.axhline(timeline["device_budget_bytes"] / 2**20, color="red", linestyle="--", label="budget")
    for kind, marker, color in (("F", "v", "tab:blue"), ("P", "^", "tab:green"), ("E", "x", "tab:red")):
        pts = [((e["t"] - t0) * 1e3, e["device_bytes"] / 2**20) for e in last if e["kind"] == kind]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, color=color,
                       label={"F": "fetch", "P": "prefetch", "E": "evict"}[kind])
    ax.set_xlabel("ms into the iteration")
    ax.set_ylabel("MiB")
    ax.set_title(f"gemini_ext memory timeline: gpt-{args.preset}, {args.policy} policy, last of {args.steps} steps")
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    summary = {"events_in_last_iteration": len(last), "steps": timeline["steps"],
               "device_budget_bytes": timeline["device_budget_bytes"], "png": args.out}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"timeline": timeline, **summary}, f)
    print(f"wrote {args.out}: {len(last)} events in the last iteration, "
          f"budget {gx.format_bytes(timeline['device_budget_bytes'])}")
    return summary


if __name__ == "__main__":
    main()
