"""Capacity: the largest GPT preset each system trains (full AdamW, or LoRA; 3 steps) on this machine.

    python bench/capacity.py                                  # on a GPU: 1.3b .. 15b
    python bench/capacity.py --presets 15b --only gemini-auto --init-device cpu   # built on the host
    python bench/capacity.py --presets 6.7b,13b --only gemini-offload-all
    python bench/capacity.py --gpus 2                         # nvidia-h200-x2: 13b .. 30b, sharded
    python bench/capacity.py --gpus 8                         # nvidia-h200-x8: 30b, 40b, 80b
    python bench/capacity.py --smoke                          # tiny and small (two ranks: tiny) on sim (tests)
    python bench/capacity.py --lora 16 --presets 30b,40b,80b --init-device meta   # LoRA on a frozen base

Every attempt is a fresh process (bench/offload.py's runners), batch 1 x 1024 tokens with
activation checkpointing in every system, presets in ascending size; a system stops at its first
failure (out of memory, a timeout, a crash), which the table names; a gemini_ext run that fails
after its steps (in close()) keeps their times in --json-out as the attempt's partial_summary. Systems:
  plain               the model on the GPU, fused AdamW on the GPU
  fsdp2-offload       FSDP2 + CPUOffloadPolicy(pin_memory=True), fused CPU AdamW
  gemini-auto         gemini_ext's auto policy (optimizer state the host cannot hold stays on the
                      device)
  gemini-offload-all  gemini_ext static with parameters homed on the host and the optimizer state
                      on the host (the device holds the chunks in use and activations)
Every system builds the model on the GPU (--init-device cuda; on the host, initialising a 13B model
takes minutes even on 16 cores): gemini_ext's enable() takes it into
chunks, releasing each original tensor as it goes; FSDP2's fully_shard moves each shard to the
host under CPUOffloadPolicy; plain keeps it there. With several GPUs every system builds it on the
meta device instead (--init-device meta, the default there), so that no rank holds the whole model
(80B in fp32 is 324 GB): gemini_ext's enable() gives each module storage as it reaches it;
FSDP2 shards the meta model, then to_empty() gives each rank storage for its shards and
GPT.init_weights fills them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offload import GEMINI, PEER, run_system  # noqa: E402  (same directory)
from scaling import run as run_torchrun  # noqa: E402

PRESETS = ["1.3b", "6.7b", "13b", "15b"]
MULTI_GPU_PRESETS = {2: ["13b", "20b", "30b"], 4: ["20b", "30b", "40b"], 8: ["30b", "40b", "80b"]}


def systems(init: str = "cuda") -> dict[str, tuple[str, list[str]]]:
    return {
        "plain": (PEER, ["--plain", "--init-device", init]),
        "fsdp2-offload": (PEER, ["--offload", "--init-device", init]),
        "gemini-auto": (GEMINI, ["--policy", "auto", "--init-device", init]),
        "gemini-offload-all": (GEMINI, ["--policy", "static", "--offload-param-frac", "1.0", "--init-device", init]),
    }


def default_presets(gpus: int) -> list[str]:
    if gpus == 1:
        return PRESETS
    return MULTI_GPU_PRESETS[max(k for k in MULTI_GPU_PRESETS if k <= gpus)]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default=None,
                   help="ascending, comma-separated (default: " + ",".join(PRESETS) + "; with --gpus N > 1: " +
                        "; ".join(f"{n}+: {','.join(v)}" for n, v in MULTI_GPU_PRESETS.items()) + ")")
    p.add_argument("--gpus", type=int, default=1, help="ranks (GPUs) per attempt, launched with torchrun; the model is "
                   "sharded over them (gemini_ext ZeRO-3, FSDP2); plain needs 1")
    p.add_argument("--init-device", choices=["cpu", "cuda", "meta"], default=None,
                   help="where every system builds the model (default: cuda on one GPU, meta on several; cpu: "
                        "gemini_ext initialises the host-built model on every core, --host-init-threads, the peers "
                        "with torch's own initialisation)")
    p.add_argument("--only", default=None, help="comma-separated subset of: " + ", ".join(systems()))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=int, default=1200, help="seconds per attempt")
    p.add_argument("--json-out", default=None)
    p.add_argument("--search-range-m", type=float, default=None,
                   help="gemini_ext's search_range_m (examples/train_gpt.py's default otherwise)")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="LoRA of rank R on a frozen base (examples/train_gpt.py --lora): gemini_ext systems only")
    p.add_argument("--smoke", action="store_true", help="tiny and small on the CPU (sim): the harness only")
    args = p.parse_args(argv)
    names = list(systems())
    if args.gpus > 1:
        names.remove("plain")  # one process, no sharding
    presets = [x.strip() for x in args.presets.split(",")] if args.presets else default_presets(args.gpus)
    init = args.init_device = args.init_device or ("meta" if args.gpus > 1 else "cuda")
    if args.smoke:
        # plain PyTorch's script is the offload smoke's too; two ranks check the launch path (one
        # system, one preset), the search from preset to preset is the one-process run's
        presets, args.seq, names = ["tiny", "small"], 16, ["gemini-auto", "gemini-offload-all"]
        if args.gpus > 1:
            presets, names = ["tiny"], ["gemini-auto"]
    if args.only:
        names = [n.strip() for n in args.only.split(",")]
        unknown = set(names) - set(systems())
        if unknown:
            p.error(f"--only: unknown systems {sorted(unknown)}; choose from {list(systems())}")
        if args.gpus > 1 and "plain" in names:
            p.error("--only plain with --gpus > 1: plain PyTorch runs on one GPU; leave it out or use --gpus 1")
    if args.lora:
        peers = [n for n in names if systems()[n][0] != GEMINI]
        if args.only and peers:
            p.error(f"--lora: {peers} have no LoRA runner; choose gemini_ext systems")
        names = [n for n in names if n not in peers]
    cores = os.cpu_count() or 1
    rows = []
    for name in names:
        script, extra = systems(init)[name]
        if args.search_range_m and script == GEMINI:
            extra = extra + ["--search-range-m", str(args.search_range_m)]
        if args.lora:
            extra = extra + ["--lora", str(args.lora)]
        if init == "cpu" and script == GEMINI:
            extra = extra + ["--host-init-threads", str(cores)]
        if args.smoke:  # a CPU machine: the model is built on the CPU, gemini_ext runs on sim
            extra = [x if x != "cuda" else "cpu" for x in extra] + (["--device", "sim"] if script == GEMINI else [])
        row = {"system": name, "attempts": []}
        for preset in presets:
            common = ["--preset", preset, "--steps", str(args.steps), "--batch", str(args.batch), "--checkpoint"]
            if args.seq:
                common += ["--seq", str(args.seq)]
            if args.gpus > 1:
                s = run_torchrun(script, extra, common, args.gpus, max(1, cores // args.gpus), args.timeout)
            else:
                s = run_system(script, extra, common, args.timeout)
            row["attempts"].append({"preset": preset, **s})
            status = s.get("error") or f"{s['step_s_median']:.2f} s/step"
            print(f"{name} {preset}: {status}", flush=True)
            if "error" in s:
                row["first_failure"] = {"preset": preset, "error": s["error"]}
                break
            row["largest"] = {"preset": preset, **s}
        rows.append(row)
    lora = f", LoRA r={args.lora} on a frozen base" if args.lora else ", full AdamW"
    print(f"\nlargest preset trained for {args.steps} steps on {args.gpus} GPU(s), batch {args.batch} per GPU, "
          f"activation checkpointing{lora}\n")
    print("| system | largest | parameters | step s | setup s | first step s | peak device GiB (worst rank) "
          "| peak host GiB (all ranks) | first failure |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        big = r.get("largest")
        fail = r.get("first_failure")
        fail_text = f"{fail['preset']}: {fail['error'][:80]}" if fail else "-"
        if big is None:
            print(f"| {r['system']} | none | | | | | | | {fail_text} |")
            continue
        # setup: enable() for gemini_ext, building + sharding + initialising for the peers; the
        # first step includes the warm-up (and auto's placement decision)
        trainable = f" ({big['trainable_parameters'] / 1e6:.0f}M trainable)" if args.lora else ""
        print(f"| {r['system']} | {big['preset']} | {big['parameters'] / 1e9:.2f}B{trainable} | "
              f"{big['step_s_median']:.2f} | "
              f"{big['setup_seconds']['total']:.1f} | {big['step_seconds'][0]:.2f} | "
              f"{big['peak_device_bytes_max_rank'] / 2**30:.1f} | {big['peak_host_rss_bytes_all_ranks'] / 2**30:.1f} | "
              f"{fail_text} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
