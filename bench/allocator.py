"""Allocator overhead: GEMINI_EXT_ALLOCATOR=chunk against PyTorch's caching allocator (default).

Each measurement runs in a fresh process per mode (the mode is chosen at import):
  1. allocations per second: torch.empty / free of a mix of sizes (256 B to 64 MiB, the sizes
     a transformer step allocates), on the current stream, after a warm-up that fills the caches;
  2. step time of examples/train_gpt.py on the same model and batch in both modes.

    python bench/allocator.py --preset 1.3b --steps 8 --repeats 2   # on a GPU
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

MICRO = r"""
import json, time
import gemini_ext as gx
import torch
sizes = [256, 4096, 65536, 1 << 20, 4 << 20, 16 << 20, 64 << 20] * 8
torch.cuda.init()
for _ in range(3):  # warm-up: the caches hold every size
    held = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes]
    del held
torch.cuda.synchronize()
n, start = 0, time.perf_counter()
while time.perf_counter() - start < 2.0:
    held = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes]
    del held
    n += len(sizes)
torch.cuda.synchronize()
elapsed = time.perf_counter() - start
print(json.dumps({"mode": gx.memory_stats()["mode"], "allocs_per_s": n / elapsed}))
"""


def run_mode(mode: str, args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, GEMINI_EXT_ALLOCATOR=mode)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, env=env)


def measure(mode: str, args) -> dict:
    row = {"mode": mode}
    micro = run_mode(mode, ["-c", MICRO])
    if micro.returncode != 0:
        row["error"] = (micro.stderr.strip().splitlines() or ["?"])[-1]
        return row
    row["allocs_per_s"] = json.loads(micro.stdout.strip().splitlines()[-1])["allocs_per_s"]
    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "s.json")
        train = run_mode(mode, ["examples/train_gpt.py", "--preset", args.preset, "--steps", str(args.steps),
                                "--batch", str(args.batch), "--policy", args.policy, "--json-out", out_json,
                                "--no-progress"])
        if train.returncode != 0:
            row["error"] = (train.stderr.strip().splitlines() or ["?"])[-1]
            return row
        with open(out_json) as f:
            s = json.load(f)
    row.update(step_ms=s["step_s_median"] * 1e3, tokens_per_s=s["tokens_per_s"],
               torch_peak_GiB=(s["peak_torch_device_bytes"] or 0) / 2**30, last_loss=s["last_loss"])
    return row


def summarise(mode: str, runs: list[dict]) -> dict:
    """The median over a mode's runs, with the range of step times; the first failure otherwise."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    out = {"mode": mode, "runs": runs}
    for key in ("allocs_per_s", "step_ms", "tokens_per_s", "torch_peak_GiB", "last_loss"):
        out[key] = statistics.median(r[key] for r in runs)
    out["step_ms_range"] = (min(r["step_ms"] for r in runs), max(r["step_ms"] for r in runs))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="1.3b")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--policy", default="auto")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per mode, interleaved (default, chunk, default, ...): the spread shows the noise")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    runs = []
    for rep in range(args.repeats):
        for mode in ("default", "chunk"):
            runs.append(measure(mode, args))
    rows = [summarise(mode, [r for r in runs if r["mode"] == mode]) for mode in ("default", "chunk")]
    base = rows[0]
    print(f"gpt-{args.preset}, {args.batch} x 1024 tokens, policy {args.policy}, {args.steps} steps (median after the "
          f"first), {args.repeats} runs per mode interleaved: medians over runs, step time range in brackets\n")
    print("| mode | allocations/s | step ms [range] | vs default | tokens/s | torch-side peak GiB | last loss |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['mode']} | failed: {r['error'][:100]} ||||||")
            continue
        ratio = r["step_ms"] / base["step_ms"] if "step_ms" in base else float("nan")
        low, high = r["step_ms_range"]
        print(f"| {r['mode']} | {r['allocs_per_s']:,.0f} | {r['step_ms']:.1f} [{low:.1f}-{high:.1f}] | {ratio:.3f} | "
              f"{r['tokens_per_s']:,.0f} | "
              f"{r['torch_peak_GiB']:.2f} | {r['last_loss']:.4f} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return {"rows": rows}


if __name__ == "__main__":
    main()
