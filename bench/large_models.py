"""Large models on one GPU: step time, tokens/s and MFU of gemini_ext `auto` over model sizes and
batches, with the overlap bound of each row and the peers beside them, in one run.
    python3 bench/large_models.py --presets 6.7b,13b,15b --batches 1,4,8,16 --out /tmp/large
    python3 bench/large_models.py --presets 15b --batches 16 --peers none       # one row
    python3 bench/large_models.py --presets 25b --batches 8 --state 8byte --peers none \
        --extra "--init-device meta"                                            # the 8-byte state
    python3 bench/large_models.py --smoke                                       # tiny, sim (tests)
Every row is a fresh process (examples/train_gpt.py, or the peers' scripts through bench/offload.py's
runner): the model built on the GPU, full AdamW, activation checkpointing per block and the loss over
--loss-chunk-tokens tokens at a time (checkpointed pieces: one piece's logits live at once), clipping at
--max-norm (1.0); --step-in-backward (with --max-norm 0) starts gemini_ext's host steps during backward.
A first process measures the machine's rates in the same run: gemini_ext's CPU Adam kernel
(parameters/s, bf16 gradient in and bf16 copy out, over the --state the rows use), the device's kernel
over the same pinned arrays (the link lane), both at once on disjoint parts, a host memory copy
(2 GiB read and written), pinned H2D and D2H bandwidth, and per preset and
batch the GPU's forward + backward time of the bf16 model held whole on the device (the GPU work
an offloading system cannot do without; built on the device, so it fits up to about 30B).
The overlap bound of a row is max(GPU, the host's state of the last step over the CPU Adam rate (plus
the device kernel's rate over the link where the link lane took part), that step's PCIe bytes / the
slower direction's bandwidth). MFU counts 6 N FLOPs per token
(recomputation not credited) against the GPU's bf16 dense peak from the engine's table.
Beside each gemini_ext row, `gemini-ext estimate` (gx.estimate on the preset built on meta, with the CPU
Adam rate measured in this run) predicts the step before the row runs; the error is (predicted -
measured) / measured.
Columns: the split is the chunk sets whose optimizer state is on the device / the host, and the
parameters the CPU stepped; peak device is chunks plus torch's allocations, each at its peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import offload  # noqa: E402  (bench/offload.py: the runner, failure records and peers' commands)

# --state: the flags examples/train_gpt.py and `gemini-ext estimate` both take for it
STATES = {"fp32": [], "bf16": ["--optimizer-state-dtype", "bf16"],
          "8byte": ["--optimizer-state-dtype", "bf16", "--no-master-weights"]}

RATES = r"""
import dataclasses, json, sys, time
import torch
sys.path.insert(0, REPO)
import gemini_ext as gx
from gemini_ext.models import GPT, GPT_PRESETS, synthetic_batch, checkpoint_blocks
presets, batches, seq_arg, smoke, state, loss_chunk = ARGS
out = {"gpu_compute_s": {}}
n = 1 << 20 if smoke else 1 << 26
# the state the rows train with: fp32 master and moments, bf16 moments, or the 8-byte state
p = torch.zeros(n, dtype=torch.bfloat16 if state == "8byte" else torch.float32)
m, v = (torch.zeros(n, dtype=torch.float32 if state == "fp32" else torch.bfloat16) for _ in range(2))
g = torch.randn(n).bfloat16()
p16 = None if state == "8byte" else torch.empty(n, dtype=torch.bfloat16)
def adam(step):
    gx._C.cpu_adam_step(p, m, v, g, p16, step=step, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                        adamw=True, grad_scale=1.0, isa="")
adam(1)
best = min((lambda t0: (adam(2), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(4))
out["cpu_adam_params_per_s"] = n / best
if torch.cuda.is_available():  # the device's kernel over the same pinned host arrays (the link lane)
    mapped = [t if t is None else gx._C.mapped_device_view(t.pin_memory(), torch.device("cuda"))
              for t in (p, m, v, g, p16)]
    def link(step):
        gx._C.device_adam_step(*mapped[:4], mapped[4], step=step, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.1, max_blocks=gx._C.LINK_LANE_BLOCKS)
        torch.cuda.synchronize()
    link(1)
    best = min((lambda t0: (link(2), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(3))
    out["link_adam_params_per_s"] = n / best
    # both lanes at once on disjoint parts (the link lane's share as in the 15.4B rows' split): each
    # lane's rate while the other runs, over its own time (the one done first then runs alone)
    k = int(n * 0.3) // 64 * 64
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    gx._C.device_adam_step(*(t if t is None else t[:k] for t in mapped), step=3, lr=1e-4, beta1=0.9, beta2=0.999,
                           eps=1e-8, weight_decay=0.1, max_blocks=gx._C.LINK_LANE_BLOCKS)
    end.record()
    t0 = time.perf_counter()
    gx._C.cpu_adam_step(*(t if t is None else t[k:] for t in (p, m, v, g, p16)), step=3, lr=1e-4, beta1=0.9,
                        beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True, grad_scale=1.0, isa="")
    cpu_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    out["together_cpu_params_per_s"] = (n - k) / cpu_s
    out["together_link_params_per_s"] = k / (start.elapsed_time(end) / 1e3)
    del mapped
del p, m, v, g, p16
# the host's memory: a copy between two 1 GiB arrays (2 GiB read and written; 8 MiB under --smoke)
a = torch.ones(1 << (21 if smoke else 28))
b = torch.empty_like(a)
best = min((lambda t0: (b.copy_(a), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(4))
out["host_copy_bytes_per_s"] = 2 * a.numel() * 4 / best
del a, b
if torch.cuda.is_available():
    dev = torch.device("cuda")
    host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    gpu = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    for name, fn in (("h2d", lambda: gpu.copy_(host, non_blocking=True)),
                     ("d2h", lambda: host.copy_(gpu, non_blocking=True))):
        fn(); torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(8): fn()
        torch.cuda.synchronize()
        out[name + "_bytes_per_s"] = 8 * host.numel() / (time.perf_counter() - t0)
    del host, gpu
    for preset in presets:
        cfg = dataclasses.replace(GPT_PRESETS[preset], loss_chunk_tokens=loss_chunk)
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        with torch.device(dev):
            model = GPT(cfg)
        torch.set_default_dtype(default)
        checkpoint_blocks(model)
        seq = seq_arg or cfg.max_seq_len
        for batch in batches:
            x, y = synthetic_batch(cfg, batch, seq, 0, dev)
            times = []
            for i in range(3):
                torch.cuda.synchronize(); t0 = time.perf_counter()
                model(x, y).backward()
                torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
            out["gpu_compute_s"][f"{preset}/{batch}"] = min(times[1:])
            print(f"gpu {preset} {batch}: {min(times[1:]):.3f} s", file=sys.stderr, flush=True)
        del model, x, y
        torch.cuda.empty_cache()
print(json.dumps(out))
"""


def measure_rates(presets: list[str], batches: list[int], seq: int | None, smoke: bool, state: str,
                  loss_chunk_tokens: int, timeout: int) -> dict:
    code = RATES.replace("REPO", repr(offload.REPO)).replace(
        "ARGS", repr((presets, batches, seq, smoke, state, loss_chunk_tokens)))
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=offload.REPO,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if proc.returncode != 0:
        return {"error": offload.last_error(proc)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def predict(preset: str, batch: int, state: str, loss_chunk_tokens: int, rates: dict, timeout: int,
            max_norm: float = 1.0, step_in_backward: bool = False) -> dict:
    """gx.estimate's prediction of a row (gemini-ext estimate on the preset built on meta)."""
    cmd = [sys.executable, "-m", "gemini_ext", "estimate", "--preset", preset, "--tokens-per-step", str(batch * 1024),
           "--loss-chunk-tokens", str(loss_chunk_tokens), "--max-norm", str(max_norm), "--json", *STATES[state]]
    if step_in_backward:
        cmd.append("--step-in-backward")
    if "cpu_adam_params_per_s" in rates:
        cmd += ["--cpu-rate", str(rates["cpu_adam_params_per_s"])]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=offload.REPO, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if proc.returncode != 0:
        return {"error": offload.last_error(proc)}
    return json.loads(proc.stdout)


def derive(system: str, preset: str, s: dict, rates: dict) -> dict:
    """The row's figures from a run's summary and the machine's rates."""
    row = {"system": system, "preset": preset, "batch": s["batch"], "step_s": s["step_s_median"],
           "tokens_per_s": s["tokens_per_s"], "parameters": s["parameters"],
           "peak_device_bytes": s.get("peak_device_bytes_max_rank"),
           "peak_host_bytes": s.get("peak_host_rss_bytes_max_rank"),
           "last_loss": s.get("last_loss")}
    row["model_tflops"] = 6 * s["parameters"] * s["tokens_per_s"] / 1e12
    peak = (s.get("throughput") or {}).get("peak_tflops") or rates.get("peak_tflops")
    row["mfu"] = row["model_tflops"] / peak if peak else None
    host_params, pcie = offload.host_params_and_pcie(system, s)
    parts = {}
    gpu = rates.get("gpu_compute_s", {}).get(f"{preset}/{s['batch']}")
    if gpu is not None:
        parts["gpu"] = gpu
    if "cpu_adam_params_per_s" in rates:  # the host's state, stepped by the CPU (and the device over the link)
        last = s.get("last_optimizer_step") or {}
        link = int(last.get("link_params", 0))
        together = rates["cpu_adam_params_per_s"] + (rates.get("link_adam_params_per_s", 0.0) if link else 0.0)
        parts["cpu_adam"] = host_params / together
    if pcie is not None and "h2d_bytes_per_s" in rates:
        parts["pcie"] = pcie / min(rates["h2d_bytes_per_s"], rates["d2h_bytes_per_s"])
    row["bound_parts_s"] = parts
    row["bound_s"] = max(parts.values()) if "gpu" in parts else None
    row["host_params"] = host_params
    if system.startswith("gemini"):
        placement = s.get("placement") or {}
        row["split"] = f"{placement.get('optim_chunks_on_device', '?')} / {placement.get('optim_chunks_on_host', '?')}"
        if placement.get("optim_chunks_link_lane"):
            row["split"] += f" ({placement['optim_chunks_link_lane']} via link)"
        row["pcie_bytes"] = pcie
        last = s["per_step"][-1]
        row["forward_s"], row["backward_s"] = last.get("forward_seconds"), last.get("backward_seconds")
        row["exposed_optimizer_s"] = s.get("exposed_optimizer_s_median")
        step = s.get("last_optimizer_step") or {}  # each lane's rate in the step (parameters/s)
        row["lanes_in_step"] = {lane: step[f"{key}_params"] / step[f"{key}_seconds"]
                                for lane, key in (("cpu", "host"), ("link", "link"))
                                if step.get(f"{key}_params") and step.get(f"{key}_seconds")}
        row["lane_rebalances"] = {k: v for k, v in (placement.get("decision") or {}).items()
                                  if k.startswith("rebalance_") or k == "lane_rebalances"}
    return row


def estimated(row: dict) -> str:
    e = row.get("estimate")
    if not e:
        return "-"
    if "error" in e:
        return "failed: " + e["error"][:60]
    return f"{e['step_time_s']:.3f} ({(e['step_time_s'] - row['step_s']) / row['step_s']:+.1%})"


def table(rows: list[dict], rates: dict) -> str:
    f = offload.fmt
    lines = ["| system | model | tokens/step | step s | tokens/s | MFU | split (sets device / host, CPU-stepped) | "
             "peak device GiB | peak host GiB | bound s (GPU / CPU Adam / PCIe) | step / bound | estimate s (error) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['system']} | {r['preset']} | {r['batch']} x 1024 |"
        if "error" in r or "skipped" in r:
            lines.append(head + (f" skipped: {r['skipped']}" if "skipped" in r else f" failed: {r['error'][:110]}")
                         + " ||||||||||")
            continue
        parts = r["bound_parts_s"]
        bound = " / ".join(f(parts.get(k), ".2f") for k in ("gpu", "cpu_adam", "pcie"))
        split = f"{r['split'] if 'split' in r else 'host'}, {r['host_params'] / 1e9:.2f}B"
        lines.append(head + f" {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {f(r['mfu'], '.1%')} | {split} | "
                     f"{f(r['peak_device_bytes'] and r['peak_device_bytes'] / 2**30, '.1f')} | "
                     f"{f(r['peak_host_bytes'] and r['peak_host_bytes'] / 2**30, '.1f')} | {bound} | "
                     f"{f(r['bound_s'] and r['step_s'] / r['bound_s'], '.2f')} | {estimated(r)} |")
    rate = ", ".join(f"{k} {v:.4g}" for k, v in rates.items() if isinstance(v, float))
    return "\n".join(lines + ["", f"Rates measured in this run: {rate}"])


def write(out: str | None, rows: list[dict], runs: list[dict], rates: dict, args) -> str:
    text = table(rows, rates)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
        with open(out + ".md", "w") as f:
            f.write(text + "\n")
        with open(out + ".json", "w") as f:
            json.dump({"args": vars(args), "rates": rates, "rows": rows, "runs": runs}, f, indent=2)
    return text


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="6.7b,13b,15b")
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--peers", default="fsdp2-offload,deepspeed-offload", help="peer systems, or none")
    p.add_argument("--peer-presets", default="6.7b,13b")
    p.add_argument("--peer-batches", default="1,16")
    p.add_argument("--peer-rows", default="", help="the peers' rows as preset/batch, comma-separated (in place of "
                   "--peer-presets x --peer-batches; e.g. 6.7b/1,6.7b/16,13b/1), each for every peer or, "
                   "as peer@preset/batch, for that one")
    p.add_argument("--timeout", type=int, default=420, help="seconds per row")
    p.add_argument("--state", choices=sorted(STATES), default="fp32",
                   help="gemini_ext's optimizer state: fp32 (exact), bf16 moments, or the 8-byte state (both change "
                        "the numerics); the peers keep fp32")
    p.add_argument("--loss-chunk-tokens", type=int, default=2048,
                   help="every system's loss over this many tokens at a time, checkpointed (0: the whole batch)")
    p.add_argument("--max-norm", type=float, default=1.0, help="every system's gradient clipping (0: off)")
    p.add_argument("--step-in-backward", action="store_true",
                   help="gemini_ext steps host-held state in place during backward (optimizer_step_in_backward; "
                        "needs --max-norm 0)")
    p.add_argument("--extra", default="", help="more arguments for examples/train_gpt.py, space-separated")
    p.add_argument("--skip", default="", help="rows to leave out, as preset/batch, comma-separated (e.g. 15b/16)")
    p.add_argument("--out", default=None, help="path prefix for .md and .json (rewritten after every row)")
    p.add_argument("--smoke", action="store_true", help="gpt-tiny on sim, no peers (tests)")
    args = p.parse_args(argv)
    presets, batches = args.presets.split(","), [int(b) for b in args.batches.split(",")]
    peers = [] if args.peers == "none" else args.peers.split(",")
    seq = None
    if args.smoke:
        presets, batches, peers, args.steps, seq = ["tiny"], [1, 2], [], 3, 16
    rates = measure_rates(presets, batches, seq, args.smoke, args.state, args.loss_chunk_tokens, args.timeout)
    print(f"rates: {rates}", flush=True)
    skip = set(filter(None, args.skip.split(",")))
    jobs = [("gemini-auto", pr, b) for pr in presets for b in batches if f"{pr}/{b}" not in skip]
    peer_rows = (args.peer_rows.split(",") if args.peer_rows else
                 [f"{pr}/{b}" for pr in args.peer_presets.split(",") for b in args.peer_batches.split(",")])
    for entry in peer_rows:
        only, _, row = entry.rpartition("@")
        jobs += [(peer, row.split("/")[0], int(row.split("/")[1])) for peer in peers if only in ("", peer)]
    rows, summaries = [], []
    for system, preset, batch in jobs:
        common = ["--preset", preset, "--steps", str(args.steps), "--batch", str(batch), "--max-norm",
                  str(args.max_norm),
                  "--checkpoint",
                  "--loss-chunk-tokens", str(args.loss_chunk_tokens)]
        if seq:
            common += ["--seq", str(seq)]
        script, extra = offload.systems(None)[system]
        if script == offload.GEMINI:
            extra = extra + (["--device", "sim"] if args.smoke else ["--init-device", "cuda"]) + STATES[args.state]
            extra += args.extra.split() + (["--step-in-backward"] if args.step_in_backward else [])
        elif script == offload.PEER:
            extra = extra + ["--init-device", "cuda"]
        why_not = offload.peer_unavailable(system) if script == offload.OTHER_PEERS else None
        s = {"skipped": why_not} if why_not else offload.run_system(script, extra, common, args.timeout)
        row = derive(system, preset, s, rates) if "tokens_per_s" in s else {"system": system, "preset": preset,
                                                                            "batch": batch, **s}
        if script == offload.GEMINI and "error" not in row and not args.smoke:
            row["estimate"] = predict(preset, batch, args.state, args.loss_chunk_tokens, rates, args.timeout,
                                      args.max_norm, args.step_in_backward)
        rows.append(row)
        summaries.append({"system": system, "preset": preset, "batch": batch, "summary": s})
        write(args.out, rows, summaries, rates, args)  # what ran so far survives a later timeout
        print(f"{system} {preset} {batch}: " + (s.get("error") or s.get("skipped") or
              f"{s['step_s_median']:.3f} s/step, {s['tokens_per_s']:,.0f} tokens/s, "
              f"MFU {offload.fmt(row.get('mfu'), '.1%')}"),
              flush=True)
    print("\n" + write(args.out, rows, summaries, rates, args))
    return rows


if __name__ == "__main__":
    main()
