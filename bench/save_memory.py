"""What saving costs each rank: peak host memory and time of each way to save an engine's state.

Every (mode, world size) runs in a fresh set of processes (torch.multiprocessing, gloo), the
model built on meta and materialised by gx.enable, one AdamW step taken so that the optimizer
has state. Each rank resets its peak RSS (/proc/self/clear_refs) just before the save and
reports how far its RSS rose above where it was (the dictionary or buffers the save built), and
the save's wall time. Modes:
- full:    engine.state_dict() on every rank (the whole fp32 model everywhere)
- rank0:   engine.state_dict(StateDictOptions(full_state_dict=True, cpu_offload=True)), streamed
- engine:  engine.save_checkpoint(dir) (each rank writes its shard, model and optimizer)
- dcp:     dcp.save of the sharded state dicts (model and optimizer, DTensors over the ranks)
- dcp-async: dcp.async_save of the same, timed until its future completes (and until it returns)
and, for the two checkpoint formats, the load into a fresh engine (`--load`).

    python bench/save_memory.py --world 4 --preset 110m --chunk-m 4 --load   # CPU, sim, gloo
    python bench/save_memory.py --world 1 --device cuda --preset 1.3b --load --dir /tmp/ck   # one GPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRESETS = {  # GPTConfig fields
    "tiny": dict(vocab_size=512, d_model=128, n_layers=2, n_heads=4, max_seq_len=128),
    "110m": dict(vocab_size=32000, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024),
    "350m": dict(vocab_size=32000, d_model=1024, n_layers=24, n_heads=16, max_seq_len=1024),
    "1.3b": dict(vocab_size=32000, d_model=2048, n_layers=24, n_heads=16, max_seq_len=1024),
}
MODES = ["full", "rank0", "engine", "dcp", "dcp-async"]


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, args, out_dir):
    import gemini_ext as gx
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from gemini_ext.models import GPT, GPTConfig, synthetic_batch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    group = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        group = dist.group.WORLD
    cfg = GPTConfig(**PRESETS[args.preset])
    with torch.device("meta"):
        model = GPT(cfg)
    config = gx.GeminiConfig(device=args.device, precision="bf16" if args.device == "cuda" else "fp32",
                             placement_policy="auto" if args.device == "cuda" else "static",
                             **({"chunk_config_dict": {"chunk_size": int(args.chunk_m * 2**20)}}
                                if args.chunk_m else {}))
    target = os.path.join(args.dir, args.mode)
    report = {"rank": rank}
    with gx.enable(model, config, process_group=group) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-4)
        x, y = synthetic_batch(cfg, 1, 128, 0, engine.compute_device)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        engine.synchronize()
        sharded = StateDictOptions(full_state_dict=False)
        if world > 1:
            dist.barrier()
        before = rss_bytes()
        reset_peak()
        start = time.perf_counter()
        if args.mode == "full":
            held = engine.state_dict()
        elif args.mode == "rank0":
            held = engine.state_dict(StateDictOptions(full_state_dict=True, cpu_offload=True))
        elif args.mode == "engine":
            engine.save_checkpoint(target)
            held = None
        else:
            held = {"model": engine.state_dict(sharded), "optim": opt.state_dict(sharded)}
            if args.mode == "dcp":
                dcp.save(held, checkpoint_id=target)
            else:
                future = dcp.async_save(held, checkpoint_id=target)
                report["returned_s"] = time.perf_counter() - start  # what the training loop waits
                future.result()
        report["save_s"] = time.perf_counter() - start
        report["peak_growth_bytes"] = rss_bytes("VmHWM") - before
        del held
        if args.load and args.mode in ("engine", "dcp", "dcp-async"):
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            if args.mode == "engine":
                engine.load_checkpoint(target)
            else:
                state = {"model": engine.state_dict(sharded), "optim": opt.state_dict(sharded)}
                dcp.load(state, checkpoint_id=target)
                engine.load_state_dict(state["model"])
                opt.load_state_dict(state["optim"])
                del state
            engine.synchronize()
            report["load_s"] = time.perf_counter() - start
        report["model_fp32_bytes"] = 4 * sum(p.numel() for p in model.parameters())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if world > 1:
        dist.destroy_process_group()


def run(args) -> list[dict]:
    # Blocks of 1 MiB and more come from mmap and go back at free, so that RSS follows what is
    # live (glibc otherwise keeps freed heap, and a peak would count earlier garbage).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank, args=(args.world, _free_port(), args, out_dir), nprocs=args.world, join=True,
                           start_method="spawn")
        return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(args.world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="110m")
    ap.add_argument("--device", choices=["sim", "cuda"], default="sim")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--chunk-m", type=float, default=None,
                    help="chunk size in 2**20 elements (default: the engine's search, at least 32)")
    ap.add_argument("--load", action="store_true", help="time loading the checkpoint formats back")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    args = ap.parse_args()
    scratch = None
    if args.dir is None:
        args.dir = scratch = tempfile.mkdtemp(prefix="save_memory-")
    print(f"{args.preset} GPT, {args.world} rank(s), device={args.device}; peak RSS growth during the save, "
          "per rank, MiB (and as a fraction of the fp32 model)")
    print(f"{'mode':10s} {'save s':>7s} {'load s':>7s}  per-rank peak growth MiB")
    try:
        for mode in args.modes.split(","):
            args.mode = mode
            reports = run(args)
            model_mib = reports[0]["model_fp32_bytes"] / 2**20
            growth = [r["peak_growth_bytes"] / 2**20 for r in reports]
            save = max(r["save_s"] for r in reports)
            load = max((r.get("load_s", float("nan")) for r in reports))
            print(f"{mode:10s} {save:7.2f} {load:7.2f}  " + " ".join(f"{g:7.0f}" for g in growth)
                  + f"   (model {model_mib:.0f} MiB; max {max(growth) / model_mib:.2f}x)"
                  + (f"; async_save returned after {max(r['returned_s'] for r in reports):.2f} s"
                     if "returned_s" in reports[0] else ""), flush=True)
            shutil.rmtree(os.path.join(args.dir, mode), ignore_errors=True)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
