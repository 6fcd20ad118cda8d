"""The other peers: the example GPT trained with DeepSpeed ZeRO-3 + offload or ColossalAI's Gemini,
under torchrun. Same model, synthetic batches, AdamW settings, clipping and summary keys as
examples/train_gpt.py and bench/fsdp2_train.py, so bench/offload.py puts all of them side by side.

    torchrun --nproc-per-node 1 bench/peers_train.py --system deepspeed-offload --preset 1.3b
    torchrun --nproc-per-node 1 bench/peers_train.py --system colossalai-auto --preset 1.3b \
        --stubs DIR          # import-only stand-ins for packages ColossalAI imports but never calls

Systems:
  deepspeed-offload        ZeRO-3, parameters and optimizer state offloaded to pinned host memory,
                           DeepSpeedCPUAdam (AdamW mode), bf16
  deepspeed-offload-optim  ZeRO-3, only the optimizer state offloaded
  colossalai-static        GeminiPlugin(placement_policy="static", offload_optim_frac=1.0), HybridAdam
  colossalai-auto          GeminiPlugin(placement_policy="auto"), HybridAdam
Neither package is a dependency of gemini_ext: install them yourself (both JIT-build their CPU Adam
and CUDA kernels on first use, which takes minutes; set TORCH_EXTENSIONS_DIR to keep them).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

from fsdp2_train import (GPT, GPT_PRESETS, add_common_args, cap_device_memory, checkpoint_blocks,
                         exit_without_teardown, finish, run_steps, summarize)

SYSTEMS = ("deepspeed-offload", "deepspeed-offload-optim", "colossalai-static", "colossalai-auto")
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.999), 1e-8, 0.1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=SYSTEMS, required=True)
    add_common_args(p)
    p.add_argument("--stubs", default=None,
                   help="a folder appended to sys.path after transformers and peft are imported (ColossalAI)")
    return p.parse_args(argv)


def deepspeed_config(system: str, batch: int, lr: float, max_norm: float) -> dict:
    """DeepSpeed's config for `system` (deepspeed-offload or deepspeed-offload-optim): ZeRO-3, the
    optimizer (and for deepspeed-offload the parameters) offloaded to pinned host memory, AdamW,
    bf16, clipping at max_norm (0: off; DeepSpeed clips at 1.0 when the key is absent)."""
    zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
            "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if system == "deepspeed-offload":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(BETAS), "eps": EPS,
                                                   "weight_decay": WEIGHT_DECAY}},
        "bf16": {"enabled": True},
        "gradient_clipping": max_norm,
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
    }


def deepspeed_engine(model, args):
    import deepspeed

    config = deepspeed_config(args.system, args.batch, args.lr, args.max_norm)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def train_step(x, y) -> tuple[torch.Tensor, float]:
        loss = engine(x, y)
        engine.backward(loss)
        torch.cuda.synchronize()
        before = time.perf_counter()
        engine.step()
        return loss, before

    return train_step


def colossalai_engine(model, args):
    import transformers  # noqa: F401  (their availability probes run before the stand-ins are visible)
    try:
        import peft  # noqa: F401
    except ImportError:
        pass
    if args.stubs:
        sys.path.append(args.stubs)
    import colossalai
    from colossalai.booster import Booster
    from colossalai.booster.plugin import GeminiPlugin
    from colossalai.nn.optimizer import HybridAdam

    colossalai.launch_from_torch(seed=args.seed, verbose=False)
    if args.system == "colossalai-static":
        plugin = GeminiPlugin(placement_policy="static", offload_optim_frac=1.0, offload_param_frac=0.0,
                              precision="bf16", max_norm=args.max_norm, pin_memory=True)
    else:
        plugin = GeminiPlugin(placement_policy="auto", precision="bf16", max_norm=args.max_norm, pin_memory=True)
    booster = Booster(plugin=plugin)
    optimizer = HybridAdam(model.parameters(), lr=args.lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                           adamw_mode=True)
    model, optimizer, *_ = booster.boost(model, optimizer)

    def train_step(x, y) -> tuple[torch.Tensor, float]:
        loss = model(x, y)
        booster.backward(loss, optimizer)
        torch.cuda.synchronize()
        before = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        return loss, before

    return train_step


def main(argv=None) -> dict:
    args = parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("peers_train.py: launch it with torchrun (--nproc-per-node 1 for one GPU).")
    if not torch.cuda.is_available():
        raise SystemExit(f"peers_train.py --system {args.system}: needs a CUDA device; this machine has none.")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda", torch.cuda.current_device())
    if args.system.startswith("deepspeed"):
        import deepspeed
        deepspeed.init_distributed(dist_backend="nccl")
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])

    cfg = dataclasses.replace(GPT_PRESETS[args.preset], loss_chunk_tokens=args.loss_chunk_tokens)
    seq = args.seq or cfg.max_seq_len
    torch.manual_seed(args.seed)
    if args.device_budget:
        cap_device_memory(dev, args.device_budget)
    setup_started = time.perf_counter()
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if args.checkpoint:
        checkpoint_blocks(model)
    build = deepspeed_engine if args.system.startswith("deepspeed") else colossalai_engine
    train_step = build(model, args)
    torch.cuda.reset_peak_memory_stats(dev)
    setup_seconds = {"total": time.perf_counter() - setup_started}

    losses, step_seconds, optimizer_seconds = run_steps(train_step, cfg, args, seq, dev, rank, world)
    summary = summarize(args.system, args, n_params, dev, world, seq, losses, step_seconds, optimizer_seconds,
                        setup_seconds)
    finish(summary, args, rank)
    return summary


if __name__ == "__main__":
    main()
    exit_without_teardown()
