"""The scheduler under each policy: step time and time waited on copies, side by side.

Each configuration runs examples/train_gpt.py in a fresh process on the same model, batch and
device budget, and the table reports the median step, tokens/s, and per step (averaged over the
steps after the warm-up): time compute waited on copies (measured with events: device time on
cuda), synchronous fetches, prefetches that were used, evictions, H2D/D2H bytes, the peak
chunk bytes on the device, and chunks plus torch's allocations (the figure `gpu_memory_limit` caps).

    python bench/scheduler.py --preset 1.3b --budget 16GiB --steps 8     # on a GPU
    python bench/scheduler.py --smoke                                     # tiny, on sim (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def configurations(budget: str) -> list[tuple[str, list[str]]]:
    return [
        ("static, params on device", ["--policy", "static", "--gpu-limit", budget]),
        ("static, params homed on host", ["--policy", "static", "--gpu-limit", budget, "--offload-param-frac", "1.0"]),
        ("static, no prefetch, params on host", ["--policy", "static", "--gpu-limit", budget,
                                                 "--offload-param-frac", "1.0", "--max-prefetch", "0"]),
        ("const", ["--policy", "const", "--const-budget", budget]),
        ("auto", ["--policy", "auto", "--gpu-limit", budget]),
    ]


def run(name: str, extra: list[str], common: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "summary.json")
        cmd = [sys.executable, os.path.join(REPO, "examples", "train_gpt.py"), *common, *extra,
               "--json-out", out_json, "--no-progress"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            return {"name": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        with open(out_json) as f:
            s = json.load(f)
    steps = s["per_step"][1:] or s["per_step"]  # after the warm-up iteration

    def mean(key):
        return statistics.fmean(x[key] for x in steps) if steps else 0.0

    return {"name": name, "tokens_per_s": s["tokens_per_s"], "step_ms": s["step_s_median"] * 1e3,
            "copy_wait_ms": mean("copy_wait_seconds") * 1e3, "sync_fetches": mean("sync_fetches"),
            "prefetch_hits": mean("prefetch_hits"), "evictions": mean("evictions"),
            "h2d_MiB": mean("h2d_bytes") / 2**20, "d2h_MiB": mean("d2h_bytes") / 2**20,
            "peak_chunk_MiB": s["peak_chunk_device_bytes"] / 2**20,
            # chunks plus torch's allocations (activations), each at its own peak within the
            # iteration: an upper bound of the device memory used, the figure a limit must cover
            "peak_total_MiB": max(x["device_bytes_peak"] + x["non_model_peak_bytes"] for x in steps) / 2**20
            if steps else 0.0,
            "last_loss": s["last_loss"]}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="1.3b")
    p.add_argument("--budget", default="16GiB")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing in every configuration")
    p.add_argument("--smoke", action="store_true", help="gpt-tiny on sim, 3 steps, a budget of 300 KiB")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.budget, args.steps, args.batch, args.seq, args.device = "tiny", "300KiB", 3, 2, 16, "sim"
    common = ["--preset", args.preset, "--steps", str(args.steps), "--batch", str(args.batch), "--device", args.device]
    if args.seq:
        common += ["--seq", str(args.seq)]
    if args.checkpoint:
        common.append("--checkpoint")
    print(f"gpt-{args.preset}, {args.batch} x {args.seq or 'preset'} tokens, budget {args.budget}, {args.steps} steps "
          "(per-step figures after the warm-up step)\n")
    print("| configuration | tokens/s | step ms | waited on copies ms | sync fetches | prefetch hits | evictions "
          "| H2D MiB | D2H MiB | peak chunk MiB | peak chunks + torch MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for name, extra in configurations(args.budget):  # each row as soon as it ran: long runs may be cut short
        r = run(name, extra, common)
        rows.append(r)
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error'][:80]} ||||||||||", flush=True)
            continue
        print(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {r['copy_wait_ms']:.2f} | "
              f"{r['sync_fetches']:.1f} | {r['prefetch_hits']:.1f} | {r['evictions']:.1f} | {r['h2d_MiB']:.1f} | "
              f"{r['d2h_MiB']:.1f} | {r['peak_chunk_MiB']:.1f} | {r['peak_total_MiB']:.1f} |", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
