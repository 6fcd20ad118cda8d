"""transformers' causal LMs side by side: gemini_ext `auto` (with and without the step in backward),
FSDP2 + CPU offload and DeepSpeed ZeRO-3 offload (the optimizer; parameters and optimizer), per
model and device budget, every system a fresh process (bench/hf_train.py: the model, the settings
and what each system runs), in one run.

    python3 bench/hf_models.py --models llama-7b --budgets 24GiB,40GiB,whole --out /tmp/hf
    python3 bench/hf_models.py --models mistral-7b --budgets 40GiB
    python3 bench/hf_models.py --models mixtral-1.6b --budgets 8GiB --systems gemini,gemini-sib
    python3 bench/hf_models.py --smoke              # a tiny Mixtral, gemini_ext on sim (tests)

Rows name the model, the budget and the tokens per step; columns give the median step (steps
after the first two), tokens/s, MFU (6 N FLOPs per token against --peak-tflops, N the parameters a
token computes with: an MoE's routed experts only; recomputation and attention scores not
credited), the speed-up over FSDP2 + offload and over DeepSpeed's faster row at the same budget,
the device peak (torch's allocations; for gemini_ext plus its chunks, each at its peak), the
process's peak resident host memory, and for gemini_ext the chunk bytes copied to the device per
step (the mean over every step, the first included) and what `auto` chose (the optimizer state's
split, the lane of the host steps). A system that fails is listed with its cause; one
that cannot run here (no CUDA, the package missing) as skipped. Clipping (--max-norm) is the same
for every system. Writes markdown and JSON beside --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import offload  # noqa: E402  (the runner that kills whole process trees and records failures)

TRAIN = os.path.join(offload.REPO, "bench", "hf_train.py")
SYSTEMS = {  # column name -> hf_train.py flags
    "gemini": ["--system", "gemini"],
    "gemini-sib": ["--system", "gemini", "--step-in-backward"],
    "gemini-nospec": ["--system", "gemini", "--no-speculation"],  # diagnosis: every host step from step()
    "gemini-spares": ["--system", "gemini", "--speculation", "spares"],  # the spare-copy speculation, for comparison
    "gemini-cpu-lane": ["--system", "gemini", "--cpu-lane-only"],  # diagnosis: the host sets on the CPU alone
    "fsdp2-offload": ["--system", "fsdp2-offload"],
    "deepspeed-offload-optim": ["--system", "deepspeed-offload-optim"],
    "deepspeed-offload": ["--system", "deepspeed-offload"],
    "plain": ["--system", "plain"],
    # activations planned by the engine (its checkpointing 'auto', inputs offloaded where the room needs it)
    "gemini-act": ["--system", "gemini", "--checkpointing", "engine-auto", "--activation-offload", "auto"],
    # over the model's own checkpointing (HF's): the engine offloads the inputs where the room needs it
    "gemini-hf-act": ["--system", "gemini", "--activation-offload", "auto"],
    "gemini-act-offload": ["--system", "gemini", "--checkpointing", "engine-on", "--activation-offload", "on"],
    "fsdp2-offload-act": ["--system", "fsdp2-offload", "--activation-offload", "on"],  # torch's save_on_cpu
    # DeepSpeed's activation checkpointing with cpu_checkpointing (the layers' inputs in CPU memory)
    "deepspeed-offload-optim-act": ["--system", "deepspeed-offload-optim", "--activation-offload", "on"],
    "gpu-alone": ["--system", "gpu-alone"],  # forward and backward only, parameters resident, no optimizer
}
LABELS = {"gemini": "gemini_ext auto", "gemini-sib": "gemini_ext auto + step in backward",
          "gemini-nospec": "gemini_ext auto, no speculation",
          "gemini-spares": "gemini_ext auto, spare-copy speculation",
          "gemini-cpu-lane": "gemini_ext auto, CPU lane only",
          "fsdp2-offload": "FSDP2 + CPU offload", "deepspeed-offload-optim": "DeepSpeed ZeRO-3, optimizer offloaded",
          "deepspeed-offload": "DeepSpeed ZeRO-3, parameters and optimizer offloaded", "plain": "plain PyTorch",
          "gemini-act": "gemini_ext auto, activations planned",
          "gemini-hf-act": "gemini_ext auto, activations planned over HF's checkpointing",
          "gemini-act-offload": "gemini_ext auto, inputs offloaded",
          "fsdp2-offload-act": "FSDP2 + CPU offload + save_on_cpu",
          "deepspeed-offload-optim-act": "DeepSpeed ZeRO-3, optimizer offloaded, CPU checkpointing",
          "gpu-alone": "GPU alone (forward and backward)"}


def unavailable(name: str, smoke: bool) -> str | None:
    """Why a system cannot run here, or None."""
    if smoke:
        return None if name.startswith("gemini") else "the smoke run trains gemini_ext on sim only"
    if name.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not importable here"
    import torch
    return None if torch.cuda.is_available() else "needs a CUDA device"


def run_row(name: str, common: list[str], budget: str | None, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "row.json")
        cmd, env = offload.launch(TRAIN, [*common, *SYSTEMS[name], "--json-out", out_json,
                                          *(["--budget", budget] if budget else [])], ranks=1)
        try:
            proc = offload.run_job(cmd, timeout, env)
        except offload.JobTimedOut as e:
            return e.record
        if proc.returncode != 0 or not os.path.exists(out_json):
            return offload.failure(proc, None)
        with open(out_json) as f:
            return json.load(f)


def auto_choice(row: dict) -> str:
    """What gemini_ext's auto chose: optimizer chunks on the device / on the host (of which the link
    lane steps some), and where the host sets stepped."""
    placement = (row.get("engine") or {}).get("placement") or {}
    if not placement:
        return ""
    lanes = placement.get("optim_chunks_link_lane")
    lane = f", {lanes} via the link" if lanes else ""
    started = (placement.get("host_steps") or {}).get("during_backward")
    return (f"optimizer chunks {placement.get('optim_chunks_on_device', '?')} device / "
            f"{placement.get('optim_chunks_on_host', '?')} host{lane}" +
            (f", host steps started in backward: {started}" if started else "") + speculation_choice(row) +
            activation_choice(row) + bound(row))


def bound(row: dict) -> str:
    """The lane that bounded the engine's last settled step and its busy seconds, beside the GPU's
    (engine.stats()["lanes"])."""
    lanes = (row.get("engine") or {}).get("lanes") or {}
    busy = lanes.get("busy_seconds") or {}
    if not lanes.get("bound"):
        return ""
    gpu = f"; GPU {busy['gpu']:.2f} s" if lanes["bound"] != "gpu" else ""
    return f"; bound: {lanes['bound']} {busy[lanes['bound']]:.2f} s busy{gpu}"


def speculation_choice(row: dict) -> str:
    """The in-place guesses of the last step: held, or corrected (and the correction's seconds)."""
    spec = (row.get("engine") or {}).get("speculation") or {}
    last = spec.get("last_step") or {}
    if not last.get("guessed_sets"):
        return f"; spares {spec['spare_bytes'] / 2**30:.1f} GiB" if spec.get("spare_bytes") else ""
    if last.get("held"):
        return f"; last step: {last['guessed_sets']} sets' guesses held"
    return (f"; last step: {last['corrected_sets']} of {last['guessed_sets']} sets corrected "
            f"({last['correction_seconds']:.2f} s of CPU)")


def clip_fraction(row: dict) -> str:
    """Of the steps whose norm the system reported, the fraction above max_norm."""
    norms, max_norm = row.get("grad_norms") or [], row.get("max_norm") or 0.0
    if not max_norm or not norms:
        return "-"
    return f"{sum(n > max_norm for n in norms)}/{len(norms)}"


def activation_choice(row: dict) -> str:
    """The engine's activation plan: blocks kept, recomputed, recomputed with the input offloaded,
    and the bytes the offload moved per step."""
    acts = (row.get("engine") or {}).get("activations") or {}
    plan, offload = acts.get("plan") or {}, acts.get("offload") or {}
    text = ""
    if plan.get("decided"):
        text += (f"; blocks {plan['keep']} kept / {plan['recompute']} recomputed / {plan['offload']} offloaded"
                 f" (room {plan['device_free_bytes'] / 2**30:.1f} GiB)")
    elif (acts.get("checkpointing") or {}).get("checkpointed_calls"):
        text += f"; {acts['checkpointing']['blocks']} blocks checkpointed by the engine"
    if offload.get("offloaded"):
        text += f"; {offload['offloaded_bytes'] / row['steps'] / 1e9:.1f} GB/step to host"
    return text


def table(results: list[dict], peak_tflops: float) -> str:
    lines = ["| model | budget | tokens/step | system | step s | tokens/s | MFU | x FSDP2 | x DeepSpeed | "
             "device peak GiB | host RSS peak GiB | H2D GB/step | clipped | auto chose |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        same = [o for o in results if o["model"] == r["model"] and o["budget"] == r["budget"] and "step_s_median" in o]
        fsdp2 = next((o["step_s_median"] for o in same if o["name"] == "fsdp2-offload"), None)
        ds = min((o["step_s_median"] for o in same if o["name"].startswith("deepspeed")), default=None)
        head = f"| {r['model']} | {r['budget'] or 'whole device'} | {r['tokens_per_step']:,} | {LABELS[r['name']]} |"
        if "step_s_median" not in r:
            lines.append(f"{head} {r.get('skipped') or r.get('error', '?')} | | | | | | | | | |")
            continue
        step = r["step_s_median"]
        mfu = row_mfu(r, r["tokens_per_step"], peak_tflops) if peak_tflops else None
        chunks = ((r.get("engine") or {}).get("tier_bytes") or {}).get("device", {}).get("peak", 0)
        peak = (r.get("peak_torch_device_bytes") or 0) + chunks
        rss = r.get("peak_host_rss_bytes")
        h2d = ((r.get("engine") or {}).get("traffic") or {}).get("h2d_bytes")  # the engine's, over every step
        cells = [f"{step:.3f}", f"{r['tokens_per_step'] / step:,.0f}", "-" if mfu is None else f"{mfu:.1%}",
                 f"{fsdp2 / step:.2f}" if fsdp2 else "-", f"{ds / step:.2f}" if ds else "-",
                 f"{peak / 2**30:.1f}" if peak else "-", f"{rss / 2**30:.1f}" if rss else "-",
                 f"{h2d / r['steps'] / 1e9:.1f}" if h2d is not None else "-", clip_fraction(r), auto_choice(r)]
        lines.append(head + " " + " | ".join(cells) + " |")
    return "\n".join(lines)


def row_mfu(row: dict, tokens_per_step: int, peak_tflops: float) -> float:
    """6 N FLOPs per token over the row's median step against the peak; N the parameters a token
    computes with (an MoE: the experts a token is routed to)."""
    active = row.get("active_parameters") or row["parameters"]
    return 6 * active * tokens_per_step / row["step_s_median"] / (peak_tflops * 1e12)


def save(text: str, results: list[dict], out: str | None) -> str:
    """`text` (returned) and `results` as markdown and JSON beside the path prefix `out`, if any."""
    if out:
        with open(out + ".md", "w") as f:
            f.write(text + "\n")
        with open(out + ".json", "w") as f:
            json.dump(results, f, indent=2, default=str)
    return text


def write_tables(results: list[dict], args) -> str:
    """The markdown table of `results` (returned), written with the JSON beside --out."""
    peak = None if args.smoke else args.peak_tflops  # sim has no peak: no MFU
    mfu = f"MFU against {peak:.0f} TFLOP/s" if peak else "no MFU on sim"
    return save(f"{args.steps} steps, median after the first two, clipping {args.max_norm or 'off'}, loss scaled by "
                f"{args.loss_scale:g}, {mfu}\n\n" + table(results, peak), results, args.out)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama-7b", help="comma-separated names of bench/hf_train.py's MODELS")
    p.add_argument("--budgets", default="24GiB,40GiB,whole", help="comma-separated; 'whole': the whole device")
    p.add_argument("--systems", default="gemini,gemini-sib,fsdp2-offload,deepspeed-offload-optim,deepspeed-offload",
                   help="comma-separated subset of: " + ", ".join(SYSTEMS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--max-norm", type=float, default=0.0, help="clipping for every system (0: off)")
    p.add_argument("--loss-scale", type=float, default=1.0,
                   help="every system backward from the loss times this (bench/hf_train.py: Adam's step is the "
                        "same, the norm scaled; 1/64 keeps the norm within --max-norm 1.0)")
    p.add_argument("--loss-chunk-tokens", type=int, default=0,
                   help="every system: the LM head and loss this many tokens at a time (0: HF's own loss)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100 SXM, H200)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per row")
    p.add_argument("--out", default=None, help="path prefix for .md and .json")
    p.add_argument("--smoke", action="store_true", help="a tiny Mixtral, gemini_ext on sim")
    p.add_argument("--timelines", default=None, metavar="DIR",
                   help="each row: one more step under torch.profiler, its trace and PNG in DIR/MODEL-BUDGET-SYSTEM/ "
                        "(bench/timeline.py)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = set(names) - set(SYSTEMS)
    if unknown:
        p.error(f"--systems: unknown {sorted(unknown)}; choose from {list(SYSTEMS)}")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    budgets = [None if b.strip() == "whole" else b.strip() for b in args.budgets.split(",") if b.strip()]
    common = ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
              "--max-norm", str(args.max_norm), "--loss-chunk-tokens", str(args.loss_chunk_tokens),
              "--loss-scale", str(args.loss_scale)]
    if args.smoke:
        models, budgets, common = ["tiny-mixtral"], [None], \
            ["--batch", "2", "--seq", "32", "--steps", "3", "--max-norm", str(args.max_norm), "--device", "sim",
             "--loss-scale", str(args.loss_scale)]
    results = []
    for model in models:
        for budget in budgets:
            for name in names:
                why_not = unavailable(name, args.smoke)
                timeline = ["--timeline", os.path.join(args.timelines, f"{model}-{budget or 'whole'}-{name}")] \
                    if args.timelines else []
                row = {"skipped": why_not} if why_not else run_row(name, ["--model", model, *common, *timeline],
                                                                  budget, args.timeout)
                row.update(name=name, model=model, budget=budget,
                           tokens_per_step=int(common[1]) * int(common[3]))
                results.append(row)
                print(f"{model} {budget or 'whole device'} {name}: " + (
                    f"{row['step_s_median']:.3f} s/step" if "step_s_median" in row else
                    row.get("skipped") or row.get("error", "?")), flush=True)
                write_tables(results, args)  # after every row: a run cut short keeps what it measured
    print("\n" + write_tables(results, args))
    return results


if __name__ == "__main__":
    main()
