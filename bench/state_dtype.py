"""fp32 optimizer state against bf16 moments (GeminiConfig.optimizer_state_dtype) and the 8-byte
state (bf16 moments with master_weights=False: no fp32 master, the bf16 parameters updated with
stochastic rounding): the loss curves, step time and memory of the same training run, side by side
in one call.

    python bench/state_dtype.py --preset 1.3b --steps 300 --batch 8 --budget 24GiB
    python bench/state_dtype.py --smoke          # tiny, sim (tests)

Each configuration is examples/train_gpt.py in a fresh process (bench/offload.py's runner) with
the same seed and data. The table gives the loss at a few steps, each curve's largest difference
from the fp32 one (and over the last tenth of the steps, the mean difference), the median step,
and the peak device and host memory; --plot writes the curves.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offload import GEMINI, run_system  # noqa: E402  (same directory)


# name: (train_gpt.py's flags, what the table calls it)
STATES = {"fp32": ([], "fp32 state"), "bf16": (["--optimizer-state-dtype", "bf16"], "bf16 moments"),
          "8byte": (["--optimizer-state-dtype", "bf16", "--no-master-weights"], "8-byte state")}


def table(rows: dict) -> str:
    ok = {k: r for k, r in rows.items() if "error" not in r}
    lines = []
    if ok:
        steps = len(next(iter(ok.values()))["losses"])
        marks = sorted({0, steps // 4, steps // 2, 3 * steps // 4, steps - 1})
        lines += ["| step | " + " | ".join(str(i + 1) for i in marks) + " |", "|---" * (len(marks) + 1) + "|"]
        for name, r in ok.items():
            lines.append(f"| {STATES[name][1]} loss | " + " | ".join(f"{r['losses'][i]:.4f}" for i in marks) + " |")
        lines.append("")
        base = ok.get("fp32", {}).get("losses")
        tail = max(1, steps // 10)
        for name, r in ok.items():
            if base is None or name == "fp32":
                continue
            diffs = [y - x for x, y in zip(base, r["losses"])]
            lines.append(f"{STATES[name][1]} against fp32 state over {steps} steps: largest difference "
                         f"{max(map(abs, diffs)):.4f}, mean over the last {tail} steps "
                         f"{sum(diffs[-tail:]) / tail:+.4f}")
        lines.append("")
    lines += ["| optimizer state | median step ms | tokens/s | peak device GiB | peak host GiB |",
              "|---|---|---|---|---|"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {STATES[name][1]} | failed: {r['error'][:90]} | | | |")
            continue
        lines.append(f"| {STATES[name][1]} | {r['step_s_median'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['peak_device_bytes_max_rank'] / 2**30:.2f} | "
                     f"{r['peak_host_rss_bytes_max_rank'] / 2**30:.2f} |")
    return "\n".join(lines)


def plot(rows: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, r in rows.items():
        if "losses" in r:
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=STATES[name][1], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="1.3b")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--states", default="fp32,bf16,8byte", help=f"comma-separated, of {sorted(STATES)}")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--budget", default=None, help="gpu_memory_limit, e.g. 24GiB (default: the whole device)")
    p.add_argument("--policy", default="auto")
    p.add_argument("--init-device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block")
    p.add_argument("--timeout", type=int, default=600, help="seconds per configuration")
    p.add_argument("--json-out", default=None)
    p.add_argument("--plot", default=None, help="write the loss curves to this PNG")
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
    for name in args.states.split(","):
        if name not in STATES:
            p.error(f"--states: {name!r} is not one of {sorted(STATES)}")
        rows[name] = run_system(GEMINI, STATES[name][0], common, args.timeout)
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
