"""The peer: the example GPT trained with PyTorch FSDP2 (fully_shard per block and at the root),
with or without CPUOffloadPolicy, under torchrun. Same model, synthetic batches, AdamW settings,
clipping and summary keys as examples/train_gpt.py, so bench scripts can put both side by side.

    torchrun --nproc-per-node 2 bench/fsdp2_train.py --preset 1.3b --steps 6 --json-out s.json
    torchrun --nproc-per-node 2 bench/fsdp2_train.py --preset 1.3b --offload ...   # CPU offload
    torchrun --nproc-per-node 1 bench/fsdp2_train.py --preset 1.3b --plain ...     # plain PyTorch

Mixed precision as in MEASUREMENTS.md: fp32 parameters and optimizer state, bf16 compute
(MixedPrecisionPolicy param_dtype=bf16), fp32 gradient reduction. Without offload the optimizer is
fused AdamW on the GPU; with CPUOffloadPolicy(pin_memory=True) it is fused AdamW on the CPU. The
process group pairs NCCL for cuda tensors with gloo for cpu ones: clipping under CPU offload
reduces norms of host gradients. On a machine without CUDA it runs on the CPU over gloo (smoke).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_by_path(name: str, *path: str):
    """A module of gemini_ext by path: the peer runs the same model and optimizers without loading
    gemini_ext."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "gemini_ext", *path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


_gpt = _load_by_path("gx_gpt", "models", "gpt.py")
_load_by_path("gx_lion", "optim", "lion.py")
_optimizers = _load_by_path("gx_optimizers", "models", "optimizers.py")
OPTIMIZERS, optimizer_spec = _optimizers.OPTIMIZERS, _optimizers.optimizer_spec
GPT, GPT_PRESETS = _gpt.GPT, _gpt.GPT_PRESETS
synthetic_batch, checkpoint_blocks = _gpt.synthetic_batch, _gpt.checkpoint_blocks


def add_common_args(p: argparse.ArgumentParser) -> None:
    """The arguments every peer runner takes (bench/offload.py passes them to each)."""
    p.add_argument("--preset", choices=sorted(GPT_PRESETS), default="125m")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's max)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--optim", choices=OPTIMIZERS, default="adamw",
                   help="the optimizer (gemini_ext/models/optimizers.py); torch's fused kernel where it has one")
    p.add_argument("--max-norm", type=float, default=1.0, help="global gradient-norm clipping (0: off)")
    p.add_argument("--device-budget", default=None,
                   help="cap torch's allocator at this many bytes (e.g. 16GiB) via set_per_process_memory_fraction")
    p.add_argument("--checkpoint", action="store_true", help="non-reentrant activation checkpointing per block")
    p.add_argument("--loss-chunk-tokens", type=int, default=0,
                   help="the loss over this many tokens at a time, each piece checkpointed "
                        "(GPTConfig.loss_chunk_tokens; 0: at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--offload", action="store_true", help="CPUOffloadPolicy(pin_memory=True), fused CPU AdamW")
    p.add_argument("--plain", action="store_true",
                   help="plain PyTorch instead of FSDP2: the model on the GPU, bf16 autocast, fused AdamW (one rank)")
    p.add_argument("--init-device", choices=["cpu", "cuda", "meta"], default="cpu",
                   help="where the model is built: cuda initialises a 13B model in seconds instead of minutes; "
                        "fully_shard then moves the shards to the host under --offload. meta: FSDP2's "
                        "meta-device flow (fully_shard on meta, to_empty, then GPT.init_weights on the shards): "
                        "no rank holds the whole model")
    return p.parse_args(argv)


def _parse_bytes(text: str) -> int:
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def summarize(system: str, args, n_params: int, dev: torch.device, world: int, seq: int, losses: list[float],
              step_seconds: list[float], optimizer_seconds: list[float], setup_seconds: dict) -> dict:
    """The summary every peer runner writes (examples/train_gpt.py's keys): throughput and medians
    over the steps after the first, peaks over ranks (a collective: every rank calls it)."""
    timed = step_seconds[1:] or step_seconds
    torch_peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # Largest and summed over ranks, from an all_gather: an all_reduce with ReduceOp.MAX on gloo
    # made about one exit in four abort in teardown under torch 2.13 (CPU), one with SUM did not.
    peaks = torch.tensor([torch_peak, rss], dtype=torch.float64, device=dev)
    gathered = [torch.empty_like(peaks) for _ in range(world)]
    dist.all_gather(gathered, peaks)
    per_rank = torch.stack(gathered)
    worst, total = per_rank.max(0).values, per_rank.sum(0)
    return {
        "system": system, "preset": args.preset,
        "parameters": n_params, "device": dev.type, "steps": args.steps, "batch": args.batch, "seq_len": seq,
        "ranks": world, "first_loss": losses[0], "last_loss": losses[-1],
        "tokens_per_s": world * args.batch * seq * len(timed) / sum(timed),
        "step_s_median": sorted(timed)[len(timed) // 2],
        "step_seconds": step_seconds, "setup_seconds": setup_seconds,
        # clipping, the optimizer step and zero_grad after backward: all on the critical path here
        "exposed_optimizer_s_median": sorted(optimizer_seconds[1:] or optimizer_seconds)[len(timed) // 2],
        "peak_device_bytes_max_rank": int(worst[0].item()),  # torch's allocations: all of the peer's
        "peak_host_rss_bytes_max_rank": int(worst[1].item()),
        "peak_host_rss_bytes_all_ranks": int(total[1].item()),
    }


def cap_device_memory(dev: torch.device, budget: str) -> None:
    """Caps torch's allocator on `dev` at `budget` bytes ("16GiB" or an int)."""
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, _parse_bytes(budget) / total), dev)


def run_steps(train_step, cfg, args, seq: int, dev: torch.device, rank: int, world: int):
    """args.steps steps of train_step(x, y) -> (loss, time the optimizer part began) on synthetic
    batches; (mean losses over ranks, step seconds, optimizer seconds)."""
    losses, step_seconds, optimizer_seconds = [], [], []
    for step in range(args.steps):
        x, y = synthetic_batch(cfg, args.batch, seq, step * world + rank, dev, seed=args.seed)
        start = time.perf_counter()
        loss, before_opt = train_step(x, y)
        loss_value = loss.item()
        step_seconds.append(time.perf_counter() - start)
        optimizer_seconds.append(time.perf_counter() - before_opt)
        t = torch.tensor([loss_value], dtype=torch.float64, device=dev)
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses, step_seconds, optimizer_seconds


def clipped_step(model, opt, max_norm: float, norms: list | None = None) -> float:
    """After backward: clipping at max_norm (0: off), the optimizer step and zero_grad; returns
    when this optimizer part began (perf_counter). The norm is appended to `norms` if given."""
    began = time.perf_counter()
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if norms is not None:
            norms.append(float(norm))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return began


def finish(summary: dict, args, rank: int, extra: str = "") -> None:
    """Rank 0 prints the summary line and writes --json-out; then the group is torn down."""
    if rank == 0:
        print(f"== {summary['system']}: gpt-{args.preset} ({summary['parameters'] / 1e6:.1f}M params) on "
              f"{summary['ranks']} x {summary['device']}, loss {summary['first_loss']:.4f} -> "
              f"{summary['last_loss']:.4f}, "
              f"{summary['tokens_per_s']:,.0f} tokens/s, median step {summary['step_s_median'] * 1e3:.1f} ms" + extra)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(summary, f, indent=2)
    dist.barrier()  # no rank tears the group down while another still uses it (gloo aborts otherwise)
    dist.destroy_process_group()


def main(argv=None) -> dict:
    args = parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("fsdp2_train.py: launch it with torchrun (--nproc-per-node 1 for one GPU).")
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("cuda:nccl,cpu:gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    mesh = init_device_mesh(dev.type, (world,))

    cfg = dataclasses.replace(GPT_PRESETS[args.preset], loss_chunk_tokens=args.loss_chunk_tokens)
    seq = args.seq or cfg.max_seq_len
    torch.manual_seed(args.seed)
    if args.init_device == "cuda" and not on_cuda:
        raise SystemExit("fsdp2_train.py --init-device cuda: this machine has no CUDA device; use --init-device cpu.")
    setup_started = time.perf_counter()  # model built, sharded and initialised: enable()'s counterpart
    with torch.device({"cuda": dev, "cpu": torch.device("cpu"), "meta": torch.device("meta")}[args.init_device]):
        model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if args.checkpoint:
        checkpoint_blocks(model)
    if args.device_budget and on_cuda:
        cap_device_memory(dev, args.device_budget)
    if args.plain:
        if world != 1:
            raise SystemExit("fsdp2_train.py --plain: one rank only (plain PyTorch has no sharding).")
        if args.init_device != "meta":
            model.to(dev)
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_cuda else \
            MixedPrecisionPolicy()
        offload = CPUOffloadPolicy(pin_memory=True) if args.offload else OffloadPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    if args.init_device == "meta":  # storage for this rank's shards only (the whole model under --plain)
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)  # same Parameter objects: ties hold
        try:
            model.to_empty(device="cpu" if args.offload else dev)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swap)
        torch.manual_seed(args.seed)
        with torch.no_grad():
            model.apply(model.init_weights)
    opt_cls, opt_kw = optimizer_spec(args.optim, args.lr)
    if args.optim == "adamw":
        opt_kw["fused"] = on_cuda or None
    elif args.optim == "sgd":
        opt_kw["foreach"] = True  # torch's fused SGD has no DTensor sharding strategy
    else:
        opt_kw["foreach"] = False  # Lion (gemini_ext's, torch has none) tensor by tensor: FSDP2's DTensors
    opt = opt_cls(model.parameters(), **opt_kw)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(dev)

    setup_seconds = {"total": time.perf_counter() - setup_started}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.plain and on_cuda)

    def train_step(x, y) -> tuple[torch.Tensor, float]:
        with autocast:
            loss = model(x, y)
        loss.backward()
        if on_cuda:
            torch.cuda.synchronize(dev)  # the optimizer's time below starts where backward ended
        return loss, clipped_step(model, opt, args.max_norm)

    losses, step_seconds, optimizer_seconds = run_steps(train_step, cfg, args, seq, dev, rank, world)
    summary = summarize("plain pytorch" if args.plain else "fsdp2" + (" + cpu offload" if args.offload else ""),
                        args, n_params, dev, world, seq, losses, step_seconds, optimizer_seconds, setup_seconds)
    finish(summary, args, rank, f", peak device {summary['peak_device_bytes_max_rank'] / 2**30:.2f} GiB/rank, host "
                                f"RSS {summary['peak_host_rss_bytes_all_ranks'] / 2**30:.2f} GiB over ranks")
    return summary


def exit_without_teardown() -> None:
    """Under torch 2.13 (CPU build) over gloo, about one FSDP2 process exit in ten aborted in the
    interpreter's teardown ("terminate called without an active exception", no Python frame),
    after the run and its summary were complete and without gemini_ext loaded (this file loads
    only the model's source). Leave without that teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_without_teardown()
