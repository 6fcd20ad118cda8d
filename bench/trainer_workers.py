"""transformers' Llama through GeminiTrainer with DataLoader workers: the step time and the host
memory of the process and its workers while it trains.

    python bench/trainer_workers.py --preset 7b --budget 40GiB --workers 2 --steps 8
    python bench/trainer_workers.py --preset tiny --device sim --workers 2 --steps 4   # anywhere

The model is built from a config (no weights downloaded) with HF's gradient checkpointing, bf16,
AdamW, no clipping, synthetic token sequences. A callback samples at every step end the host's
MemAvailable and the proportional set size of this process and its children (the DataLoader's
workers: shared pages counted once), so a worker that inherits the engine's host memory shows as
growth while the engine rewrites it. Prints one table row and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import transformers

import gemini_ext as gx
from gemini_ext.integrations.transformers import GeminiTrainer

PRESETS = {  # LlamaConfig fields
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=256),
}


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return -1


def group_pss_bytes() -> tuple[int, int]:
    """(Pss of this process and its children, number of children)."""
    def pss(pid):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            return 0
    kids = []
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
            kids += [int(c) for c in f.read().split()]
    return pss(os.getpid()) + sum(pss(k) for k in kids), len(kids)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int):
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Sampler(transformers.TrainerCallback):
    def __init__(self):
        self.rows = []
        self.last = None

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        pss, children = group_pss_bytes()
        self.rows.append({"step": state.global_step, "seconds": None if self.last is None else now - self.last,
                          "mem_available": mem_available_bytes(), "group_pss": pss, "children": children})
        self.last = now


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="7b")
    p.add_argument("--device", choices=["cuda", "sim"], default="cuda")
    p.add_argument("--budget", default=None, help="GeminiConfig.gpu_memory_limit (default: the whole device)")
    p.add_argument("--workers", type=int, default=2, help="TrainingArguments.dataloader_num_workers")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="/tmp/trainer_workers")
    args = p.parse_args(argv)
    cfg = transformers.LlamaConfig(**PRESETS[args.preset], max_position_embeddings=args.seq)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    started = time.perf_counter()
    with torch.device("cuda" if args.device == "cuda" else "cpu"):  # built where it is fastest to fill
        model = transformers.LlamaForCausalLM(cfg)
    built_s = time.perf_counter() - started
    training = transformers.TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=1e-4,
        weight_decay=0.1, max_grad_norm=0.0, bf16=True, use_cpu=args.device != "cuda", report_to=[],
        save_strategy="no", logging_steps=1, disable_tqdm=True, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, dataloader_num_workers=args.workers,
        dataloader_persistent_workers=args.workers > 0, seed=0)
    gemini = gx.GeminiConfig(device=args.device, placement_policy="auto", gpu_memory_limit=args.budget,
                             **({"sim_capacity": "2GiB"} if args.device == "sim" else {}))
    sampler = Sampler()
    trainer = GeminiTrainer(model=model, args=training, gemini_config=gemini, callbacks=[sampler],
                            train_dataset=Tokens(args.batch * args.steps, args.seq, cfg.vocab_size))
    enabled_s = time.perf_counter() - started - built_s
    before = {"mem_available": mem_available_bytes(), "group_pss": group_pss_bytes()[0]}
    trainer.train()
    stats = trainer.engine.stats()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainer.close()
    rows = sampler.rows
    times = [r["seconds"] for r in rows if r["seconds"] is not None]
    later = times[len(times) // 2:] or times
    result = {
        "preset": args.preset, "device": args.device, "budget": args.budget, "workers": args.workers,
        "tokens_per_step": args.batch * args.seq, "build_s": built_s, "enable_s": enabled_s,
        "median_step_s": statistics.median(later) if later else None,
        "host_bytes": stats["host_bytes"], "children_seen": max((r["children"] for r in rows), default=0),
        "mem_available_before": before["mem_available"], "mem_available_min": min(r["mem_available"] for r in rows),
        "group_pss_before": before["group_pss"], "group_pss_after_first_step": rows[0]["group_pss"],
        "group_pss_last": rows[-1]["group_pss"], "group_pss_max": max(r["group_pss"] for r in rows),
        "losses": losses,
    }
    gib = 2 ** 30
    print(f"| {args.preset} | {args.budget or 'whole device'} | {args.workers} | {args.batch} x {args.seq} | "
          f"{result['median_step_s']:.3f} s | engine host {stats['host_bytes'] / gib:.1f} GiB | MemAvailable "
          f"{before['mem_available'] / gib:.1f} -> min {result['mem_available_min'] / gib:.1f} GiB | Pss of the "
          f"process and {result['children_seen']} workers {rows[0]['group_pss'] / gib:.1f} (first step) -> "
          f"{rows[-1]['group_pss'] / gib:.1f} GiB (last), max {result['group_pss_max'] / gib:.1f} |")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
