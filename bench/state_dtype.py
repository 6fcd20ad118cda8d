"""fp32 against bf16 optimizer state (GeminiConfig.optimizer_state_dtype): the loss curves, step
time and memory of the same training run, side by side in one call.

    python bench/state_dtype.py --preset 1.3b --steps 200 --batch 8 --budget 24GiB
    python bench/state_dtype.py --smoke          # tiny, sim (tests)

Each configuration is examples/train_gpt.py in a fresh process (bench/offload.py's runner) with
the same seed and data. The table gives the loss at a few steps, the largest difference between
the two curves, the median step, and the peak device and host memory; --plot writes the curves.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offload import GEMINI, run_system  # noqa: E402  (same directory)


def table(rows: dict) -> str:
    ok = {k: r for k, r in rows.items() if "error" not in r}
    lines = []
    if len(ok) == 2:
        a, b = ok["fp32"]["losses"], ok["bf16"]["losses"]
        marks = sorted({0, len(a) // 4, len(a) // 2, 3 * len(a) // 4, len(a) - 1})
        lines += ["| step | " + " | ".join(str(i + 1) for i in marks) + " |", "|---" * (len(marks) + 1) + "|"]
        for name, curve in (("fp32 state", a), ("bf16 state", b)):
            lines.append(f"| {name} loss | " + " | ".join(f"{curve[i]:.4f}" for i in marks) + " |")
        diff = max(abs(x - y) for x, y in zip(a, b))
        lines += ["", f"largest loss difference over {len(a)} steps: {diff:.4f}", ""]
    lines += ["| optimizer state | median step ms | tokens/s | peak device GiB | peak host GiB |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:90]} | | | |")
            continue
        lines.append(f"| {name} | {r['step_s_median'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['peak_device_bytes_max_rank'] / 2**30:.2f} | {r['peak_host_rss_bytes_max_rank'] / 2**30:.2f} |")
    return "\n".join(lines)


def plot(rows: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, r in rows.items():
        if "losses" in r:
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{name} optimizer state", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="1.3b")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--budget", default=None, help="gpu_memory_limit, e.g. 24GiB (default: the whole device)")
    p.add_argument("--policy", default="auto")
    p.add_argument("--init-device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block")
    p.add_argument("--timeout", type=int, default=600, help="seconds per configuration")
    p.add_argument("--json-out", default=None)
    p.add_argument("--plot", default=None, help="write the two loss curves to this PNG")
    p.add_argument("--smoke", action="store_true", help="gpt-tiny on sim, a few steps")
    args = p.parse_args(argv)
    common = ["--preset", args.preset, "--steps", str(args.steps), "--batch", str(args.batch), "--policy", args.policy]
    if args.smoke:
        common = ["--preset", "tiny", "--steps", "4", "--batch", "2", "--seq", "16", "--device", "sim"]
    if args.budget and not args.smoke:
        common += ["--gpu-limit", args.budget]
    if args.init_device and not args.smoke:
        common += ["--init-device", args.init_device]
    if args.checkpoint and not args.smoke:
        common.append("--checkpoint")
    rows = {}
    for name in ("fp32", "bf16"):
        rows[name] = run_system(GEMINI, ["--optimizer-state-dtype", name], common, args.timeout)
        print(f"{name}: " + (rows[name].get("error") or f"{rows[name]['step_s_median'] * 1e3:.1f} ms"), flush=True)
    text = table(rows)
    print("\n" + text)
    if args.plot:
        plot(rows, args.plot)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "table": text}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
