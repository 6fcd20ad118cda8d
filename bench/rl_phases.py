"""A GRPO-shaped loop under gemini_ext, its phases timed: the policy generates, trains, hands its
weights out, and gives the device up and takes it back.

    python bench/rl_phases.py --model llama-7b --budget 40GiB --iterations 3
    python bench/rl_phases.py --model tiny-llama --device sim --iterations 2     # anywhere

The model is transformers' own, built from its config (bench/hf_train.py's MODELS, no weights
downloaded) with HF's gradient checkpointing, bf16, AdamW with fp32 masters and moments, clipping
at --max-norm (1.0: TRL's and the Trainer's default). One training step first (the engine's first
iteration measures and places); then each iteration:

  generate   --batch prompts of --prompt random tokens, --new tokens each sampled with the KV
             cache inside `engine.generating(batch_size, max_length)` (eval, no_grad)
  train      one step on the --batch x (--prompt + --new) sequences (labels = inputs): what the
             caller waits for; then `settle`, engine.synchronize(): the host's optimizer steps
             still running after step() returned (overlap_optimizer), so that no phase after it
             waits for them inside its own time
  stream     engine.named_parameters_for_inference(bf16): every parameter whole, each dropped
             once seen (what a colocated inference engine would copy into its own weights)
  offload    engine.offload_states(): the device's chunks, the optimizer sides and the pools' free
             blocks to the host (where the host cannot hold it all, what it can; the rest stays on
             the device and is in the row's "kept_on_device")
  reload     engine.reload_states(): the optimizer sides back and the next forward's first parameter
             chunks copying back; the next train step's extra time over the iteration's is printed beside it

After the iterations (and close()), `alone` generates the same shapes with the same model on the
device in bf16 without the engine (the second of two runs): the tokens/s the engine's generation is held
to. --profile DIR writes torch.profiler's table of a short generation inside the last iteration's
block (decode_profile.txt, by self time, and its chrome trace): what a token step spends its time on.

Generation also counts torch's allocator retries (a cudaFree of cached blocks and a retry, each
a device synchronisation, when an allocation meets the cap) and its device allocations.
Beside each move the link's time for its bytes at the H2D / D2H rates measured here (a pinned 1 GiB
copy). Device memory: torch's allocated and reserved bytes and the engine's chunk bytes on the
device; host: this process's resident set (VmRSS, its peak VmHWM reset before the stream).
Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_train import MODELS, build_model, build_place, fp32_bytes  # noqa: E402

GIB = 1 << 30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="llama-7b")
    p.add_argument("--device", choices=["cuda", "sim"], default="cuda")
    p.add_argument("--budget", default="40GiB", help="gpu_memory_limit (sim: sim_capacity)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=768)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--state", choices=["fp32", "8-byte"], default="fp32",
                   help="fp32 masters and AdamW moments, or the 8-byte state (bf16 parameters and moments: "
                        "optimizer_state_dtype='bf16', master_weights=False)")
    p.add_argument("--no-alone", dest="alone", action="store_false",
                   help="skip the generation without the engine after close()")
    p.add_argument("--profile", default=None, metavar="DIR", help="profile a short generation in the last block")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_rss_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
    except OSError:
        pass


def link_rates(dev: torch.device) -> dict:
    """H2D and D2H bytes per second of a pinned 1 GiB copy (median of 3); sim: None."""
    if dev.type != "cuda":
        return {"h2d": None, "d2h": None}
    buffers = {"host": torch.empty(GIB, dtype=torch.uint8, pin_memory=True),
               "device": torch.empty(GIB, dtype=torch.uint8, device=dev)}
    rates = {}
    for name, (dst, src) in (("h2d", ("device", "host")), ("d2h", ("host", "device"))):
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            buffers[dst].copy_(buffers[src], non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rates[name] = GIB / statistics.median(times)
    buffers.clear()
    torch.cuda.empty_cache()
    return rates


class Clock:
    def __init__(self, dev: torch.device):
        self.dev = dev

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def __call__(self, fn):
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t0


def device_figures(engine, dev) -> dict:
    chunks = engine.stats()["tier_bytes"]["device"]["current"]
    if dev.type != "cuda":
        return {"engine_device_bytes": chunks}
    return {"engine_device_bytes": chunks, "torch_allocated_bytes": torch.cuda.memory_allocated(dev),
            "torch_reserved_bytes": torch.cuda.memory_reserved(dev)}


def build(args):
    import gemini_ext as gx

    place, dtype = ("cpu", torch.float32)
    if args.device == "cuda":
        place, dtype = build_place(fp32_bytes(args.model), torch.cuda.get_device_properties(0).total_memory,
                                   args.state == "8-byte")
    model = build_model(args.model, args.prompt + args.new, place, dtype=dtype)
    model.generation_config.pad_token_id = 0
    budget = {"gpu_memory_limit": args.budget} if args.device == "cuda" else {"sim_capacity": args.budget}
    state = {"optimizer_state_dtype": "bf16", "master_weights": False} if args.state == "8-byte" else {}
    cfg = gx.GeminiConfig(device=args.device, precision="bf16", placement_policy="auto", max_norm=args.max_norm,
                          **budget, **state)
    engine = gx.enable(model, cfg).__enter__()
    opt = engine.optimizer(torch.optim.AdamW, model.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8,
                           weight_decay=0.1)
    return model, engine, opt


def allocator_counts(dev) -> dict:
    """torch's allocator retries and device allocations/frees so far (cuda), else {}."""
    if dev.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(dev)
    return {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}


def counts_since(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def train_step(model, opt, seqs) -> float:
    loss = model(input_ids=seqs, labels=seqs).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def stream(engine, dev) -> dict:
    """The weight stream: bytes, and the device's and host's peaks beyond what was held before it."""
    before = device_figures(engine, dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    reset_rss_peak()
    rss_before = rss_bytes()
    n = 0
    for _, tensor in engine.named_parameters_for_inference(dtype=torch.bfloat16):
        n += tensor.numel() * tensor.element_size()
        del tensor
    out = {"bytes": n, "host_peak_beyond_bytes": rss_bytes("VmHWM") - rss_before}
    if dev.type == "cuda":
        out["device_peak_beyond_bytes"] = torch.cuda.max_memory_allocated(dev) - before["torch_allocated_bytes"]
    return out


def generate(model, prompts, new: int):
    return model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=new,
                          do_sample=True, top_k=0, use_cache=True)


def prompts_of(model, args, step: int, dev) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(1, model.config.vocab_size, (args.batch, args.prompt), generator=g).to(dev)


def profile_generation(model, prompts, dev, directory: str, new: int = 8) -> None:
    """torch.profiler over a generation of `new` tokens: its table by self time and its trace."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(directory, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        generate(model, prompts, new)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    sort = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    with open(os.path.join(directory, "decode_profile.txt"), "w") as f:
        f.write(f"{new} tokens of {prompts.shape[0]} sequences after a {prompts.shape[1]}-token prompt\n")
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
        if dev.type == "cuda":
            f.write(prof.key_averages().table(sort_by=sort, row_limit=25) + "\n")
    prof.export_chrome_trace(os.path.join(directory, "decode_trace.json"))


def generate_alone(model, args, dev, clock) -> dict:
    """The same model generating the same shapes without the engine (after close(): its own
    parameters, moved to the device in the engine's compute dtype, bf16), the second of two runs."""
    model.to(device=dev, dtype=torch.bfloat16).eval()
    prompts = prompts_of(model, args, 0, dev)
    with torch.no_grad():
        for _ in range(2):
            _, seconds = clock(lambda: generate(model, prompts, args.new))
    tokens = args.batch * args.new
    return {"generate_s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def iteration(model, engine, opt, args, step: int, clock: Clock, rates: dict) -> dict:
    import transformers  # noqa: F401  (the model's generate)

    dev = engine.compute_device
    prompts = prompts_of(model, args, step, dev)
    row = {"iteration": step}
    with engine.generating(batch_size=args.batch, max_length=args.prompt + args.new) as free_bytes:
        counts = allocator_counts(dev)
        seqs, row["generate_s"] = clock(lambda: generate(model, prompts, args.new))
        row["generate_allocator"] = counts_since(counts, allocator_counts(dev))
        row["generate_kv_cache"] = dict(free_bytes)
        row["generate_device"] = device_figures(engine, dev)
        if args.profile and step == args.iterations - 1:
            profile_generation(model, prompts, dev, args.profile)
    if dev.type == "cuda":
        row["generate_torch_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
    model.train()
    row["loss"], row["train_s"] = clock(lambda: train_step(model, opt, seqs))
    _, row["settle_s"] = clock(engine.synchronize)
    row["stream"], row["stream_s"] = clock(lambda: stream(engine, dev))
    before = device_figures(engine, dev)
    moved, row["offload_s"] = clock(lambda: engine.offload_states())  # what the host cannot take stays
    row["offloaded"] = dict(moved, before=before, after=device_figures(engine, dev))
    _, row["reload_s"] = clock(engine.reload_states)
    row["reloaded_device"] = device_figures(engine, dev)
    _, row["train_after_reload_s"] = clock(lambda: train_step(model, opt, seqs))
    _, row["settle_after_reload_s"] = clock(engine.synchronize)
    if rates["h2d"]:
        row["offload_link_s"] = before["engine_device_bytes"] / rates["d2h"]
        row["reload_link_s"] = (row["reloaded_device"]["engine_device_bytes"]) / rates["h2d"]
        row["stream_link_s"] = row["stream"]["bytes"] / rates["h2d"]
    return row


def table(rows: list[dict], rates: dict) -> str:
    def gib(b):
        return f"{b / GIB:.2f}" if b is not None else "-"

    def ratio(a, b):
        return f"{a / b:.2f}x" if b else "-"

    lines = ["| it | generate s (tok/s, alloc retries) | train s + settle s | stream s (link x) | stream dev/host "
             "peak GiB | offload s (link x) | after offload: engine / torch alloc GiB | reload s (link x) | "
             "next step s (extra) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tok_s = r["tokens"] / r["generate_s"]
        after = r["offloaded"]["after"]
        lines.append(
            f"| {r['iteration']} | {r['generate_s']:.1f} ({tok_s:.0f}, "
            f"{r['generate_allocator'].get('num_alloc_retries', '-')}) | {r['train_s']:.2f} + {r['settle_s']:.2f} | "
            f"{r['stream_s']:.2f} "
            f"({ratio(r['stream_s'], r.get('stream_link_s'))}) | {gib(r['stream'].get('device_peak_beyond_bytes'))}"
            f" / {gib(r['stream']['host_peak_beyond_bytes'])} | {r['offload_s']:.2f} "
            f"({ratio(r['offload_s'], r.get('offload_link_s'))}) | {gib(after['engine_device_bytes'])} / "
            f"{gib(after.get('torch_allocated_bytes'))} | {r['reload_s']:.2f} "
            f"({ratio(r['reload_s'], r.get('reload_link_s'))}) | {r['train_after_reload_s']:.2f} "
            f"(+{r['train_after_reload_s'] - r['train_s']:.2f}) |")
    if rates["h2d"]:
        lines.append(f"\nlink: H2D {rates['h2d'] / 1e9:.1f} GB/s, D2H {rates['d2h'] / 1e9:.1f} GB/s (pinned 1 GiB)")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    model, engine, opt = build(args)
    dev = engine.compute_device
    clock = Clock(dev)
    rates = link_rates(dev)
    first = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt + args.new)).to(dev)
    _, first_s = clock(lambda: (train_step(model, opt, first), engine.synchronize()))
    print(f"first training step (measures and places): {first_s:.1f} s", flush=True)
    rows = []
    for step in range(args.iterations):
        row = iteration(model, engine, opt, args, step, clock, rates)
        row["tokens"] = args.batch * args.new
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(table(rows, rates))
    summary = {"model": args.model, "budget": args.budget, "batch": args.batch, "prompt": args.prompt,
               "new": args.new, "rates": rates, "first_step_s": first_s, "rows": rows,
               "placement": engine.stats().get("placement")}
    engine.close()
    if args.alone:
        summary["alone"] = generate_alone(model, args, dev, clock)
        engine_tok_s = statistics.median(r["tokens"] / r["generate_s"] for r in rows)
        print(f"generation alone: {summary['alone']['tokens_per_s']:.0f} tokens/s; under the engine (median of the "
              f"iterations) {engine_tok_s:.0f} tokens/s: {engine_tok_s / summary['alone']['tokens_per_s']:.2f}x")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return rows


if __name__ == "__main__":
    main()
