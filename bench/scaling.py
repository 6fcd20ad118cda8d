"""Scaling over GPUs: gemini_ext under each policy and FSDP2 with and without CPU offload, side by
side on the same model and per-GPU batch, on 1, 2, ... GPUs of one machine.

Every configuration runs in a fresh set of processes (examples/train_gpt.py or
bench/fsdp2_train.py; several ranks under torchrun, offload.launch), with OMP_NUM_THREADS =
cores / GPUs so that each rank's CPU optimizer gets its share of the cores. The table gives
global and per-GPU tokens/s, the median step, the peak device bytes of the worst rank
(gemini_ext: chunks plus torch's allocations, each at its peak; FSDP2: torch's allocations,
which are all of its memory) and the peak host RSS summed over ranks.

    python bench/scaling.py --preset 1.3b --gpus 1,2 --steps 6           # on nvidia-h200-x2
    python bench/scaling.py --preset 6.7b --gpus 1,2 --batch 2 --checkpoint --only gemini-static,fsdp2-offload
    python bench/scaling.py --smoke                                        # tiny, CPU + sim (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offload import JobTimedOut, failure, launch, run_job  # noqa: E402  (same directory)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEMINI = os.path.join(REPO, "examples", "train_gpt.py")
FSDP2 = os.path.join(REPO, "bench", "fsdp2_train.py")


def systems(budget: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (script, its arguments). gemini_ext keeps the optimizer state on the host under
    static (the default of the example) unless told otherwise; auto decides from free memory."""
    return {
        "gemini-static": (GEMINI, ["--policy", "static"]),
        "gemini-static-params-on-host": (GEMINI, ["--policy", "static", "--offload-param-frac", "1.0"]),
        "gemini-const": (GEMINI, ["--policy", "const", "--const-budget", budget]),
        "gemini-auto": (GEMINI, ["--policy", "auto"]),
        "fsdp2": (FSDP2, []),
        "fsdp2-offload": (FSDP2, ["--offload"]),
    }


def run(script: str, extra: list[str], common: list[str], n_gpus: int, threads: int, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "summary.json")
        cmd, env = launch(script, [*common, *extra, "--json-out", out_json,
                                   *(["--no-progress"] if script == GEMINI else [])], n_gpus,
                          dict(os.environ, OMP_NUM_THREADS=str(threads)))
        try:
            proc = run_job(cmd, timeout, env)
        except JobTimedOut as e:
            return e.record
        # torch 2.13's CPU build over gloo sometimes aborts in interpreter teardown after a run
        # completed ("terminate called without an active exception", no Python frame; seen with
        # FSDP2 alone too, see fsdp2_train.py): the summary is complete, the row records it.
        teardown_abort = "terminate called without an active exception" in proc.stderr
        if not os.path.exists(out_json) or (proc.returncode != 0 and not teardown_abort):
            return failure(proc, out_json)
        with open(out_json) as f:
            summary = json.load(f)
        if summary.get("closed") is False:  # only the steps' record: the run failed in close()
            return failure(proc, out_json)
        if proc.returncode != 0:
            summary["teardown_abort"] = f"exit {proc.returncode} after the summary was written"
        return summary


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="1.3b")
    p.add_argument("--gpus", default="1,2", help="comma-separated GPU counts, each one torchrun job per system")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8, help="sequences per GPU")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--budget", default="16GiB", help="const_gpu_budget of gemini-const")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing in every system")
    p.add_argument("--init-device", choices=["cpu", "cuda", "meta"], default="cuda",
                   help="where every system builds the model (cuda: seconds instead of minutes at 6.7B; meta: no "
                        "rank holds the whole model, for sizes no GPU holds; the smoke run uses cpu)")
    p.add_argument("--only", default=None, help="comma-separated subset of: " + ", ".join(systems("")))
    p.add_argument("--timeout", type=int, default=900, help="seconds per configuration")
    p.add_argument("--smoke", action="store_true", help="gpt-tiny on the CPU (sim), 1 and 2 ranks over gloo")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    names = list(systems(args.budget))
    if args.smoke:
        args.preset, args.gpus, args.steps, args.batch, args.seq = "tiny", "1,2", 3, 2, 16
        args.init_device = "cpu"
        names = ["gemini-static", "fsdp2"]  # both launch paths (auto's is the same; the capacity smoke runs it)
    if args.only:
        names = [n.strip() for n in args.only.split(",")]
        unknown = set(names) - set(systems(""))
        if unknown:
            p.error(f"--only: unknown systems {sorted(unknown)}; choose from {list(systems(''))}")
    counts = [int(g) for g in args.gpus.split(",")]
    common = ["--preset", args.preset, "--steps", str(args.steps), "--batch", str(args.batch)]
    if args.seq:
        common += ["--seq", str(args.seq)]
    if args.checkpoint:
        common.append("--checkpoint")
    common += ["--init-device", args.init_device]
    cores = os.cpu_count() or 1
    print(f"gpt-{args.preset}, {args.batch} sequences per GPU, {args.steps} steps (timed after the first), "
          f"{cores} cores shared by the ranks" + (", activation checkpointing" if args.checkpoint else "") + "\n",
          flush=True)
    print("| GPUs | system | tokens/s | tokens/s per GPU | step ms | peak device GiB (worst rank) "
          "| peak host GiB (all ranks) | last loss |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for n in counts:
        for name in names:  # each row as soon as it ran: long runs may be cut short
            script, extra = systems(args.budget)[name]
            if args.smoke and script == GEMINI:
                extra = extra + ["--device", "sim"]
            s = run(script, extra, common, n, max(1, cores // n), args.timeout)
            row = {"gpus": n, "system": name, **s}
            rows.append(row)
            if "error" in s:
                print(f"| {n} | {name} | failed: {s['error'][:100]} ||||||", flush=True)
                continue
            print(f"| {n} | {name} | {s['tokens_per_s']:,.0f} | {s['tokens_per_s'] / n:,.0f} | "
                  f"{s['step_s_median'] * 1e3:.1f} | {s['peak_device_bytes_max_rank'] / 2**30:.2f} | "
                  f"{s['peak_host_rss_bytes_all_ranks'] / 2**30:.2f} | {s['last_loss']:.4f} |", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
