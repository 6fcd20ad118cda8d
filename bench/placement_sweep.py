"""What `auto` chose against the best fixed split: gemini_ext `static` swept over the fraction of
optimizer state (and of parameter chunks) kept on the host, and `auto`, under one device budget.

    python bench/placement_sweep.py --preset 1.3b --budget 24GiB
    python bench/placement_sweep.py --preset 1.3b --budget 16GiB --optim-fracs 1.0,0.8,0.6 --param-fracs 0.0,0.5
    python bench/placement_sweep.py --preset 1.3b --budget 16GiB --checkpoint     # activations recomputed
    python bench/placement_sweep.py --preset 6.7b --batch 1 --init-device cuda     # the whole device
    python bench/placement_sweep.py --smoke                                          # tiny, sim (tests)

Every configuration is examples/train_gpt.py in a fresh process (bench/offload.py's runner),
median step after the first. `static` keeps `offload_optim_frac` of the optimizer state on the
host (from the back of the execution order) and homes `offload_param_frac` of the parameter
chunks there (from the front); what does not fit the budget is evicted. The table gives each
row's step time, where the optimizer stepped (parameters on the CPU in the last step), the
optimizer time left on the critical path, the chunk traffic of the last step, and for `auto`
what it chose. Writes JSON with --json-out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offload import GEMINI, run_system  # noqa: E402  (same directory)


def configurations(optim_fracs: list[str], param_fracs: list[str]) -> list[tuple[str, list[str]]]:
    rows = [(f"static optim {o} params {p}", ["--policy", "static", "--offload-optim-frac", o,
                                                "--offload-param-frac", p])
            for p in param_fracs for o in optim_fracs]
    return rows + [("auto", ["--policy", "auto"])]


def summarize(name: str, s: dict) -> dict:
    if "error" in s:
        return {"name": name, "error": s["error"]}
    last = s.get("per_step", [{}])[-1] if s.get("per_step") else {}
    step = s.get("last_optimizer_step") or {}
    row = {"name": name, "step_ms": s["step_s_median"] * 1e3, "tokens_per_s": s["tokens_per_s"],
           "host_params": step.get("host_params", 0), "device_params": step.get("device_params", 0),
           "exposed_optimizer_ms": s["exposed_optimizer_s_median"] * 1e3,
           "h2d_MiB": last.get("h2d_bytes", 0) / 2**20, "d2h_MiB": last.get("d2h_bytes", 0) / 2**20,
           "peak_device_GiB": s["peak_device_bytes_max_rank"] / 2**30}
    if name == "auto":
        row["decision"] = s["placement"]["decision"]
    return row


def table(rows: list[dict]) -> str:
    timed = [r for r in rows if "error" not in r and r["name"] != "auto"]
    best = min(timed, key=lambda r: r["step_ms"]) if timed else None
    lines = ["| configuration | step ms | tokens/s | params stepped on CPU / GPU | exposed optimizer ms "
             "| last step H2D / D2H MiB | peak device GiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['error'][:80]} | | | | | |")
            continue
        mark = " (best static)" if r is best else ""
        lines.append(f"| {r['name']}{mark} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['host_params']:,} / {r['device_params']:,} | "
                     f"{r['exposed_optimizer_ms']:.1f} | {r['h2d_MiB']:,.0f} / {r['d2h_MiB']:,.0f} | "
                     f"{r['peak_device_GiB']:.2f} |")
    auto = next((r for r in rows if r["name"] == "auto" and "error" not in r), None)
    if auto and best:
        d = auto["decision"]
        lines.append(f"\nauto: {auto['step_ms'] / best['step_ms']:.3f}x the best static split's step time; chunk "
                     f"budget {d.get('chunk_budget_bytes', 0) / 2**30:.2f} GiB, optimizer state of "
                     f"{d.get('optim_sets_moved_to_device', 0)} chunk sets on the device")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="1.3b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--budget", default=None,
                   help="gpu_memory_limit of every row, e.g. 24GiB (default: the whole device)")
    p.add_argument("--optim-fracs", default="1.0,0.9,0.8,0.7,0.6,0.5")
    p.add_argument("--param-fracs", default="0.0")
    p.add_argument("--init-device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block in every row")
    p.add_argument("--timeout", type=int, default=300, help="seconds per configuration")
    p.add_argument("--json-out", default=None)
    p.add_argument("--smoke", action="store_true", help="gpt-tiny on sim, two static splits and auto")
    args = p.parse_args(argv)
    common = ["--preset", args.preset, "--steps", str(args.steps), "--batch", str(args.batch)]
    optim_fracs, param_fracs = args.optim_fracs.split(","), args.param_fracs.split(",")
    if args.smoke:
        args.preset, args.batch, args.budget = "tiny", 2, None
        common = ["--preset", "tiny", "--steps", "3", "--batch", "2", "--seq", "16", "--device", "sim"]
        optim_fracs, param_fracs = ["1.0", "0.5"], ["0.0"]
    if args.seq and not args.smoke:
        common += ["--seq", str(args.seq)]
    if args.budget:
        common += ["--gpu-limit", args.budget]
    if args.init_device:
        common += ["--init-device", args.init_device]
    if args.checkpoint and not args.smoke:
        common.append("--checkpoint")
    rows = []
    for name, extra in configurations(optim_fracs, param_fracs):
        row = summarize(name, run_system(GEMINI, extra, common, args.timeout))
        rows.append(row)
        print(f"{name}: " + (row.get("error") or f"{row['step_ms']:.1f} ms"), flush=True)
    text = f"gpt-{args.preset}, batch {args.batch}, budget {args.budget or 'whole device'}\n\n{table(rows)}"
    print("\n" + text)
    if args.json_out:  # the rows and the table as printed
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "table": text}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
