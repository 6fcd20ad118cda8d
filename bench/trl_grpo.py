"""TRL's GRPO on a transformers causal LM, each iteration's phases timed: the loop users run, under
gemini_ext (GeminiTrainerMixin over trl.GRPOTrainer) and beside it without the engine, each system
in a fresh process, in one run.

    python3 bench/trl_grpo.py --model llama-7b --budget 40GiB --steps 4
    python3 bench/trl_grpo.py --model tiny-llama --device sim --steps 2     # anywhere (tests)

Systems (--systems picks some):
  gemini      GeminiGRPOTrainer: the engine's chunks under --budget (gpu_memory_limit), generation
              inside engine.generating() (the mixin's), AdamW with fp32 masters and moments
  plain       trl.GRPOTrainer with the model on the device and torch's AdamW: the floor, where the
              model and its optimizer state fit the whole device (a row that does not fit says so;
              on sim, the CPU)
  deepspeed   trl.GRPOTrainer under DeepSpeed ZeRO-3 with the optimizer and parameters offloaded to
              the host (TrainingArguments.deepspeed), where DeepSpeed imports (cuda only)

The model is built from its config (bench/hf_train.py's MODELS, no weights downloaded), with HF's
gradient checkpointing, bf16 (sim: fp32). The prompts are --prompt random token ids written as words
of a word-level tokenizer over the model's vocabulary; each prompt gets --generations completions of
--completion tokens (sampled: TRL's defaults); the reward is the share of even token ids in a
completion. One optimizer step per iteration (--prompts x --generations sequences), clipping at
--max-norm, beta 0 (TRL's default: no reference model).

Per iteration (a training step of the Trainer): `generate` (TRL's _generate_single_turn, for the
gemini row inside engine.generating()), `score` (the reward functions), `generate_and_score` (both
plus TRL's own log-probabilities and advantages), `step` (the Trainer's whole step: the above plus
forward, backward, clipping and the optimizer), each timed on the host after a device
synchronisation; a row keeps every iteration's (`phases`: `seconds` per phase). The table gives
the median over the iterations after the first. Writes a markdown table and JSON beside --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import offload  # noqa: E402  (the runner that kills whole process trees and records failures)
from hf_train import MODELS, build_model, build_place, fp32_bytes  # noqa: E402

PHASES = ("generate", "score", "generate_and_score", "step")
SYSTEMS = ("gemini", "plain", "deepspeed")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="llama-7b")
    p.add_argument("--device", choices=["cuda", "sim"], default="cuda")
    p.add_argument("--budget", default="40GiB", help="gemini's gpu_memory_limit (sim: sim_capacity)")
    p.add_argument("--systems", default="gemini,plain,deepspeed")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps (iterations)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    p.add_argument("--completion", type=int, default=256, help="completion tokens")
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--timeout", type=int, default=900, help="seconds per system")
    p.add_argument("--out", default=None, help="path prefix for .md and .json")
    p.add_argument("--one", choices=SYSTEMS, help=argparse.SUPPRESS)  # one system, in this process
    p.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def tokenizer_of(vocab_size: int):
    """A word-level tokenizer whose words are the token ids: '0' pads, '1' ends a sequence."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({str(i): i for i in range(vocab_size)}, unk_token="0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="0", eos_token="1")


def even_share(completions, **kwargs):
    return [sum(int(t) % 2 == 0 for t in c.split()) / max(1, len(c.split())) for c in completions]


def timed_trainer(base, clock: dict, sync):
    """`base` with each phase's host time appended to clock[phase] (after a device synchronisation)."""
    def timing(phase, method):
        def run(self, *args, **kwargs):
            sync()
            started = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                sync()
                clock.setdefault(phase, []).append(time.perf_counter() - started)
        return run

    names = {"generate": "_generate_single_turn", "score": "_calculate_rewards",
             "generate_and_score": "_generate_and_score_completions"}
    return type("Timed" + base.__name__, (base,),
                {method: timing(phase, getattr(base, method)) for phase, method in names.items()})


def run_one(args) -> dict:
    """One system's run in this process: its per-iteration phases and what it ended with."""
    import datasets
    import transformers
    import trl

    cuda = args.device == "cuda"
    dev = torch.device("cuda" if cuda else "cpu")
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    seq = args.prompt + args.completion
    place = "cpu"  # DeepSpeed partitions from the host; the others build on the device where that is quick
    if cuda and args.one != "deepspeed":
        place = build_place(fp32_bytes(args.model), torch.cuda.get_device_properties(dev).total_memory, False)[0]
    model = build_model(args.model, seq, place)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(str(int(t)) for t in torch.randint(2, model.config.vocab_size, (args.prompt,), generator=g))
               for _ in range(args.prompts * args.steps)]
    extra = {}
    if args.one == "deepspeed":
        host = {"device": "cpu", "pin_memory": True}
        extra["deepspeed"] = {"zero_optimization": {"stage": 3, "offload_optimizer": host, "offload_param": host},
                              "bf16": {"enabled": True}, "gradient_clipping": args.max_norm,
                              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations, max_completion_length=args.completion, max_steps=args.steps,
        learning_rate=1e-6, max_grad_norm=args.max_norm, logging_steps=1, report_to=[], save_strategy="no", seed=0,
        disable_tqdm=True, bf16=cuda, use_cpu=not cuda, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, **extra)
    clock: dict = {}
    kwargs = dict(model=model, reward_funcs=even_share, args=config, processing_class=tokenizer_of(
        model.config.vocab_size), train_dataset=datasets.Dataset.from_dict({"prompt": prompts}))
    if args.one == "gemini":
        import gemini_ext as gx
        from gemini_ext.integrations.transformers import GeminiTrainerMixin

        budget = {"gpu_memory_limit": args.budget} if cuda else {"sim_capacity": args.budget}
        base = type("GeminiGRPOTrainer", (GeminiTrainerMixin, trl.GRPOTrainer), {})
        kwargs["gemini_config"] = gx.GeminiConfig(device="cuda" if cuda else "sim", placement_policy="auto",
                                                  **budget)
    else:
        base = trl.GRPOTrainer

    class StepClock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            sync()
            self.began = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync()
            clock.setdefault("step", []).append(time.perf_counter() - self.began)

    trainer = timed_trainer(base, clock, sync)(**kwargs, callbacks=[StepClock()])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    out = {"system": args.one, "name": args.one, "model": args.model,
           "budget": args.budget if args.one == "gemini" else None,
           "tokens_per_step": args.prompts * args.generations * (args.prompt + args.completion),
           "phases": {"new_tokens_per_step": args.prompts * args.generations * args.completion, "seconds": clock},
           "rewards": [h.get("reward") for h in logs],
           "losses": [h["loss"] for h in logs], "grad_norms": [h.get("grad_norm") for h in logs],
           "device_peak_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None}
    if args.one == "gemini":
        out["engine"] = {k: trainer.engine.stats().get(k) for k in ("placement", "lanes")}
        trainer.close()
    return out


def unavailable(name: str, device: str) -> str | None:
    import importlib.util

    for package in ("trl", "datasets") + (("deepspeed",) if name == "deepspeed" else ()):
        if importlib.util.find_spec(package) is None:
            return f"{package} is not importable here"
    if name == "deepspeed" and device != "cuda":
        return "DeepSpeed's offload runs on a CUDA device"
    return None


def run_system(name: str, args, argv: list[str]) -> dict:
    why = unavailable(name, args.device)
    if why:
        return {"system": name, "skipped": why}
    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "row.json")
        cmd, env = offload.launch(os.path.abspath(__file__), [*argv, "--one", name, "--json-out", out_json], ranks=1)
        try:
            proc = offload.run_job(cmd, args.timeout, env)
        except offload.JobTimedOut as e:
            return {"system": name, **e.record}
        if proc.returncode != 0 or not os.path.exists(out_json):
            return {"system": name, **offload.failure(proc, None)}
        with open(out_json) as f:
            return json.load(f)


def median_after_first(values: list) -> float | None:
    timed = values[1:] or values
    return statistics.median(timed) if timed else None


def table(rows: list[dict], args) -> str:
    tokens = args.prompts * args.generations * args.completion
    lines = [f"{args.model}, {args.prompts} prompts x {args.generations} completions of {args.completion} tokens "
             f"({tokens} new tokens a step) after {args.prompt}-token prompts; medians after the first iteration",
             "", "| system | generate s (tokens/s) | score s | generate and score s | step s | x the floor |",
             "|---|---|---|---|---|---|"]
    floor = next((median_after_first(r["phases"]["seconds"]["step"]) for r in rows
                  if r["system"] == "plain" and "phases" in r), None)
    for r in rows:
        if "phases" not in r:
            why = r.get("skipped") or r.get("error") or "failed"
            lines.append(f"| {r['system']} | {why} | | | | |")
            continue
        m = {p: median_after_first(r["phases"]["seconds"].get(p, [])) for p in PHASES}
        gen = f"{m['generate']:.2f} ({tokens / m['generate']:.0f})" if m["generate"] else "-"
        fmt = {p: f"{m[p]:.2f}" if m[p] is not None else "-" for p in PHASES}
        x = f"{m['step'] / floor:.2f}x" if floor else "-"
        lines.append(f"| {r['system']} | {gen} | {fmt['score']} | {fmt['generate_and_score']} | {fmt['step']} | {x} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.one:
        result = run_one(args)
        with open(args.json_out, "w") as f:
            json.dump(result, f, default=str)
        return [result]
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = set(names) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"--systems: unknown {sorted(unknown)}; choose from {list(SYSTEMS)}")
    rows = []
    for name in names:
        rows.append(run_system(name, args, argv))
        print(f"{name}: " + ("done" if "phases" in rows[-1] else rows[-1].get("skipped") or rows[-1].get("error", "?")),
              flush=True)
    text = table(rows, args)
    print("\n" + text)
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write(text + "\n")
        with open(args.out + ".json", "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return rows


if __name__ == "__main__":
    main()
