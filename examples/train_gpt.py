"""Train the example GPT with gemini_ext: on the GPU where there is one, on the `sim` device otherwise.

    python examples/train_gpt.py                  # preset 'small' on sim, '125m' on a GPU
    python examples/train_gpt.py --preset 350m --steps 100 --batch 8 --seq 1024
    torchrun --nproc-per-node 2 examples/train_gpt.py     # ZeRO-3 over 2 ranks (NCCL; gloo on sim)

Parameters live in bf16 chunks with fp32 masters; the optimizer state lives on the host by
default (offload_optim_frac=1.0: gemini_ext's CPU Adam steps it), the parameters on the device.
Prints a progress bar and a closing summary: tokens/s, peak memory, chunk traffic, evictions
and where the optimizer ran. Under torchrun every rank trains on its own batch of --batch
sequences (the global batch is --batch x ranks), chunks are sharded over the ranks (ZeRO-3, or
HSDP with --extra-dp-size), and rank 0 prints the summary with global tokens/s and mean losses.
"""

from __future__ import annotations

import argparse
import dataclasses
import concurrent.futures
import json
import os
import resource
import sys
import time

import torch
from tqdm import tqdm

import gemini_ext as gx
from gemini_ext.models import GPT, GPT_PRESETS, checkpoint_blocks, synthetic_batch
from gemini_ext.models.optimizers import OPTIMIZERS, optimizer_spec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(GPT_PRESETS), default=None)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length (default: the preset's max, capped at 256 on sim)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--compile", choices=["none", "whole", "blocks"], default="none",
                   help="torch.compile the whole model or each block (inside the engine's block)")
    p.add_argument("--optim", choices=OPTIMIZERS, default="adamw",
                   help="the optimizer (gemini_ext/models/optimizers.py)")
    p.add_argument("--device", choices=["auto", "cuda", "sim"], default="auto")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--optimizer-state-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: Adam's moments in bf16 with stochastic rounding (changes the numerics)")
    p.add_argument("--no-master-weights", action="store_true",
                   help="no fp32 master: with --optimizer-state-dtype bf16 the 8-byte state (bf16 parameters "
                        "updated with stochastic rounding; changes the numerics)")
    p.add_argument("--offload-optim-frac", type=float, default=1.0)
    p.add_argument("--offload-param-frac", type=float, default=0.0)
    p.add_argument("--gpu-limit", default=None, help="device budget for chunks, e.g. 2GiB (sim: the sim capacity)")
    p.add_argument("--policy", choices=["static", "auto", "const"], default="static")
    p.add_argument("--const-budget", default=None, help="const_gpu_budget for --policy const, e.g. 8GiB")
    p.add_argument("--max-prefetch", type=int, default=2)
    p.add_argument("--search-range-m", type=float, default=None,
                   help="search_range_m of the chunk search (default: 128, or a quarter of a small model)")
    p.add_argument("--max-norm", type=float, default=1.0, help="global gradient-norm clipping (0: off)")
    p.add_argument("--checkpoint", action="store_true", help="non-reentrant activation checkpointing per block")
    p.add_argument("--loss-chunk-tokens", type=int, default=0,
                   help="the loss over this many tokens at a time, each piece checkpointed "
                        "(GPTConfig.loss_chunk_tokens; 0: at once)")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="LoRA adapters of rank R (peft) on every block's linear layers; the base is frozen")
    p.add_argument("--init-device", choices=["cpu", "cuda", "meta"], default="cpu",
                   help="where the model is built before enable() takes it into chunks (cuda: a model larger "
                        "than host memory can hold twice, e.g. 13B; meta: no whole copy anywhere, enable() "
                        "gives each module storage and GPT.init_weights values as it reaches it, e.g. a "
                        "model sharded over GPUs that no one GPU can hold)")
    p.add_argument("--model-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the dtype the model is built in (bf16: half the bytes of the caller's copy; with "
                        "--no-master-weights nothing keeps more than bf16 anyway)")
    p.add_argument("--host-init-threads", type=int, default=0,
                   help="with --init-device cpu: build the model on the meta device, give it host storage and "
                        "initialise its modules on this many threads, one random generator per module seeded "
                        "from --seed (the same distributions, other values; torch's own initialisation runs on "
                        "one core and takes minutes at 13B). 0: torch's constructor")
    p.add_argument("--no-overlap", action="store_true",
                   help="overlap_optimizer=False: the CPU optimizer step finishes inside optimizer.step()")
    p.add_argument("--step-in-backward", action="store_true",
                   help="optimizer_step_in_backward=True: host-held sets step in place during backward "
                        "(needs --max-norm 0 and bf16/fp32; exact)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra-dp-size", type=int, default=1, help="under torchrun: replicas of the ZeRO group (HSDP)")
    p.add_argument("--json-out", default=None, help="also write the summary as JSON here")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def build_on_host_threads(model_cfg, seed: int, threads: int) -> GPT:
    """A GPT in host memory, its modules initialised in parallel (see --host-init-threads)."""
    with torch.device("meta"):
        model = GPT(model_cfg)
    model.to_empty(device="cpu")
    modules = list(model.modules())

    def init(index: int) -> None:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
        model.init_weights(modules[index], generator=generator)

    with torch.no_grad(), concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(init, range(len(modules))))
    return model


def init_distributed(device_kind: str) -> tuple[int, int]:
    """(rank, world size): joins torchrun's process group when launched by it, else (0, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or torch.distributed.is_initialized():
        return (torch.distributed.get_rank(), torch.distributed.get_world_size()) if world > 1 else (0, 1)
    if device_kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group("nccl" if device_kind == "cuda" else "gloo")
    return torch.distributed.get_rank(), world


def mean_over_ranks(value: float, world: int, device) -> float:
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.item() / world


def peaks_over_ranks(values: list[int], world: int, device) -> tuple[list[int], list[int]]:
    """(largest over ranks, sum over ranks) of each value, from one all_gather (an all_reduce with
    ReduceOp.MAX on gloo made about one exit in four abort in teardown under torch 2.13, CPU)."""
    if world == 1:
        return list(values), list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(t) for _ in range(world)]
    torch.distributed.all_gather(gathered, t)
    per_rank = torch.stack(gathered)
    return [int(v) for v in per_rank.max(0).values.tolist()], [int(v) for v in per_rank.sum(0).tolist()]


def _upper_median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def step_figures(losses: list[float], step_seconds: list[float], tokens_per_step: int) -> dict:
    """Losses and step times; throughput over the steps after the first (its warm-up, and auto's
    decision, would count otherwise)."""
    timed = step_seconds[1:] or step_seconds
    return {"first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
            "tokens_per_s": tokens_per_step * len(timed) / sum(timed),  # every rank's tokens
            "step_s_median": sorted(timed)[len(timed) // 2],
            "step_seconds": step_seconds}  # every step, the first included


def add_lora(model, rank: int) -> None:
    """LoRA adapters of `rank` on the blocks' linear layers (peft, in place); everything else frozen."""
    try:
        import peft
    except ImportError:
        sys.exit('train_gpt.py --lora needs peft: pip install "gemini_ext[peft]"')
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                             target_modules=["qkv", "proj", "fc1", "fc2"])
    peft.inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device_kind = gx.resolve_device(gx.GeminiConfig(device=args.device))
    rank, world = init_distributed(device_kind)
    if rank != 0:
        args.no_progress, args.json_out = True, None
    preset = args.preset or ("125m" if device_kind == "cuda" else "small")
    model_cfg = dataclasses.replace(GPT_PRESETS[preset], loss_chunk_tokens=args.loss_chunk_tokens)
    # Chunks of about an eighth of the model (at most the 32 Mi-element default), so that even a
    # small model spreads over several chunks.
    model_m = model_cfg.num_parameters() / 2**20
    budget = {}
    if args.gpu_limit:
        budget["gpu_memory_limit" if device_kind == "cuda" else "sim_capacity"] = args.gpu_limit
    if args.policy == "const":
        budget["const_gpu_budget"] = args.const_budget or args.gpu_limit
    cfg = gx.GeminiConfig(device=args.device, precision=args.precision, placement_policy=args.policy,
                          max_prefetch=args.max_prefetch, offload_optim_frac=args.offload_optim_frac,
                          offload_param_frac=args.offload_param_frac, max_norm=args.max_norm,
                          min_chunk_size_m=min(32.0, model_m / 8),
                          search_range_m=args.search_range_m or min(128.0, model_m / 4),
                          extra_dp_size=args.extra_dp_size, overlap_optimizer=not args.no_overlap,
                          optimizer_state_dtype=args.optimizer_state_dtype,
                          master_weights=not args.no_master_weights,
                          optimizer_step_in_backward=args.step_in_backward, **budget)
    seq = args.seq or (model_cfg.max_seq_len if device_kind == "cuda" else min(256, model_cfg.max_seq_len))
    torch.manual_seed(args.seed)
    init_started = time.perf_counter()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if args.model_dtype == "bf16" else torch.float32)
    if args.host_init_threads and args.init_device == "cpu":
        model = build_on_host_threads(model_cfg, args.seed, args.host_init_threads)
    else:
        with torch.device(args.init_device):
            model = GPT(model_cfg)
    torch.set_default_dtype(default_dtype)
    if args.lora:
        with torch.device(args.init_device):  # the adapters where the base is (meta: the engine initialises them)
            add_lora(model, args.lora)
    init_seconds = time.perf_counter() - init_started
    if args.checkpoint:
        checkpoint_blocks(model)
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    losses, step_seconds, exposed_optimizer = [], [], []
    init_fn = model.init_weights if args.init_device == "meta" else None
    with gx.enable(model, cfg, param_init_fn=init_fn) as engine:
        opt_cls, opt_kw = optimizer_spec(args.optim, args.lr)
        opt = engine.optimizer(opt_cls, **opt_kw)
        dev = engine.compute_device
        forward = model
        if args.compile == "whole":
            forward = torch.compile(model)
        elif args.compile == "blocks":
            for block in model.blocks:
                block.compile()
        if dev.type == "cuda":
            gx.reset_peak_memory_stats(dev)
        bar = tqdm(range(args.steps), desc=f"gpt-{preset} on {device_kind}", disable=args.no_progress, file=sys.stdout)
        for step in bar:
            x, y = synthetic_batch(model_cfg, args.batch, seq, step * world + rank, dev, seed=args.seed)
            start = time.perf_counter()
            waited = engine.internal.runtime.counters()["optimizer_wait_seconds"]
            loss = forward(x, y)  # computes in the chunks' dtype (bf16 by default)
            loss.backward()
            before_step = time.perf_counter()
            waited_before_step = engine.internal.runtime.counters()["optimizer_wait_seconds"]
            opt.step()
            in_step = time.perf_counter() - before_step
            waited_in_step = engine.internal.runtime.counters()["optimizer_wait_seconds"] - waited_before_step
            opt.zero_grad(set_to_none=True)
            loss_value = loss.item()  # synchronises the device
            step_seconds.append(time.perf_counter() - start)
            # the optimizer's time on the critical path: inside step(), plus this iteration's
            # waits for CPU steps of the previous one (the forward settling a pending chunk)
            # (waits inside step() are part of in_step already)
            waits = engine.internal.runtime.counters()["optimizer_wait_seconds"]
            exposed_optimizer.append(in_step + waits - waited - waited_in_step)
            loss_value = mean_over_ranks(loss_value, world, dev)
            losses.append(loss_value)
            bar.set_postfix(loss=f"{loss_value:.3f}")
        torch_peak = gx.memory_stats()["allocated_bytes"]["peak"] if dev.type == "cuda" else None  # since the last step
        if args.json_out:  # the steps' record survives a close() that fails (the full summary replaces it)
            with open(args.json_out, "w") as f:
                json.dump({"preset": preset, "parameters": n_params, "ranks": world, "closed": False,
                           "setup_seconds": engine.stats()["setup_seconds"],
                           **step_figures(losses, step_seconds, world * args.batch * seq)}, f, indent=2)
        close_started = time.perf_counter()
    close_seconds = time.perf_counter() - close_started  # the model's parameters restored, the chunks freed

    stats = engine.stats()  # as of the close
    if torch_peak is not None:  # the engine measures torch's peak per iteration: the largest of them
        torch_peak = max([torch_peak] + [s.get("non_model_peak_bytes", 0) for s in stats["steps"]])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # chunks plus torch's allocations, each at its own peak: an upper bound of the device bytes used
    device_peak = stats["tier_bytes"]["device"]["peak"] + (torch_peak or 0)
    worst, total = peaks_over_ranks([device_peak, rss], world, dev)
    summary = {
        "preset": preset, "parameters": n_params, "trainable_parameters": n_trainable, "lora_rank": args.lora,
        "device": device_kind, "precision": args.precision,
        "optimizer_state_dtype": args.optimizer_state_dtype, "master_weights": not args.no_master_weights,
        "steps": args.steps, "batch": args.batch, "seq_len": seq, "ranks": world, "extra_dp_size": args.extra_dp_size,
        **step_figures(losses, step_seconds, world * args.batch * seq),
        "exposed_optimizer_s_median": _upper_median(exposed_optimizer[1:] or exposed_optimizer),
        "overlap_optimizer": not args.no_overlap, "optimizer_step_in_backward": args.step_in_backward,
        "chunks": stats["num_param_chunks"], "chunk_size_elements": stats["chunk_size"],
        "chunk_wasted_bytes": stats["wasted_bytes"],
        "peak_chunk_device_bytes": stats["tier_bytes"]["device"]["peak"],
        "peak_torch_device_bytes": torch_peak,
        "peak_host_rss_bytes": rss,
        "peak_device_bytes_max_rank": worst[0], "peak_host_rss_bytes_max_rank": worst[1],
        "peak_host_rss_bytes_all_ranks": total[1],
        "chunk_traffic": stats["traffic"],
        "counters": stats["counters"],
        "placement": stats["placement"],
        "last_optimizer_step": stats.get("last_step"),
        "skipped_steps": stats["skipped_steps"],
        "policy": args.policy,
        "init_device": args.init_device, "init_seconds": init_seconds,
        "setup_seconds": stats["setup_seconds"],  # enable(): total and per phase
        "setup_fill_seconds": stats["setup_fill_seconds"],  # its fill phase: materialise, rank 0's values, write
        "close_seconds": close_seconds,
        "per_step": stats["steps"],
        "throughput": stats["throughput"],  # this rank's tokens/s, model TFLOP/s and MFU
    }
    if rank == 0:
        t = summary["chunk_traffic"]
        lora = f", LoRA r={args.lora}: {n_trainable / 1e6:.1f}M trainable" if args.lora else ""
        print(f"\n== gemini_ext summary: gpt-{preset} ({n_params / 1e6:.1f}M params{lora}) on {device_kind}, "
              f"{args.precision}, {args.steps} steps of {args.batch} x {seq} tokens" +
              (f" on each of {world} ranks" if world > 1 else ""))
        print(f"   loss            {losses[0]:.4f} -> {losses[-1]:.4f}")
        print(f"   throughput      {summary['tokens_per_s']:,.0f} tokens/s (median step "
              f"{summary['step_s_median'] * 1e3:.1f} ms)")
        tp = stats["throughput"]
        if tp["model_tflops_per_s"] is not None:
            mfu = f"MFU {tp['mfu']:.1%} of {tp['peak_tflops']:.0f} TFLOP/s" if tp["mfu"] is not None \
                else f"no MFU: peak {tp['peak_source']}"
            print(f"   model FLOPs     {tp['model_tflops_per_s']:.1f} TFLOP/s per rank ({tp['flops_per_token_source']}"
                  f" = {tp['flops_per_token'] / 1e9:.3g} GFLOP/token), {mfu}")
        print(f"   peak memory     chunks on device {gx.format_bytes(summary['peak_chunk_device_bytes'])}"
              + (f", torch allocator {gx.format_bytes(torch_peak)}" if torch_peak is not None else "")
              + f", host RSS {gx.format_bytes(summary['peak_host_rss_bytes'])}")
        print(f"   chunks          {stats['num_param_chunks']} parameter chunks x {stats['chunk_size']:,} elements "
              f"({gx.format_bytes(stats['wasted_bytes'])} padding)")
        print(f"   chunk traffic   H2D {gx.format_bytes(t['h2d_bytes'])}, D2H {gx.format_bytes(t['d2h_bytes'])}, "
              f"{t['moves']} moves, {stats['counters']['evictions']} evictions")
        if world > 1:
            print(f"   collectives     {t['all_gathers']} chunk all-gathers, {t['reduce_scatters']} gradient "
                  f"reduce-scatters on rank 0 (ZeRO group of {world // args.extra_dp_size} ranks)")
        setup = stats["setup_seconds"]
        print(f"   enable()        {setup['total']:.2f} s (" +
              ", ".join(f"{k} {v:.2f}" for k, v in setup.items() if k != "total") + ")")
        print(f"   close           {close_seconds:.2f} s (parameters back in the model)")
        pl, ls = stats["placement"], stats.get("last_step") or {}
        link = (f"; {pl['optim_chunks_link_lane']} of them stepped by the device over the link "
                f"({ls.get('link_seconds', 0.0) * 1e3:.1f} ms)" if pl.get("optim_chunks_link_lane") else "")
        print(f"   optimizer       {pl['optim_chunks_on_host']} chunks on the host (CPU Adam, "
              f"{ls.get('host_seconds', 0.0) * 1e3:.1f} ms last step{link}), {pl['optim_chunks_on_device']} on the "
              "device")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2)
    if world > 1:
        torch.distributed.barrier()  # every rank is done with the group before any tears it down
        torch.distributed.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
