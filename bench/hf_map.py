"""The map: transformers' causal LMs under gemini_ext `auto` with activations planned
(activation_checkpointing and activation_offload "auto") at every device budget and token count
asked for, each row beside the same model's GPU alone at the same tokens (bench/hf_train.py's
gpu-alone: forward and backward, bf16 parameters resident, no optimizer), its overlap bound and
`gx.estimate`'s prediction made before the row runs, from this machine (its device, its host's
available memory, the CPU Adam rate measured here, the GPU's rate on this model from the GPU-alone
row). Every run is a fresh process (bench/hf_models.py's
runner); peers (bench/hf_models.py's systems) run beside the engine where --systems names them.

    python3 bench/hf_map.py --models llama-7b --budgets 24GiB,40GiB,whole \
        --shapes 4x2048,16x2048,32x2048,1x65536 --out /tmp/map
    python3 bench/hf_map.py --models llama-13b --state 8-byte --budgets 40GiB --shapes 16x2048
    python3 bench/hf_map.py --smoke              # a tiny Llama on sim (tests)
    python3 bench/hf_map.py --reestimate /tmp/map.json --out /tmp/map-now   # this tree's estimates of those rows

Shapes are batch x sequence length. The bound is max(GPU alone, the CPU Adam of the host-held
optimizer state at the rate the engine probed, the larger direction's copies at the link rate it
probed): no overlap can beat it. The estimate is gx.estimate with the row's config, seq_len and
loss pieces; its error is (estimate - measured) / measured. Clipping (--max-norm) and the loss in
pieces (--loss-chunk-tokens) are the same for every row. Writes markdown and JSON beside --out.
--reestimate runs nothing: it makes each engine row's estimate again with this tree's gx.estimate
from what the row's estimate was made from, a check of a changed estimate against measured rows
(not a prediction: the rows were seen first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models  # noqa: E402  (the systems and the runner of one row)

# The systems whose configuration the estimate above is made for (the engine's own checkpointing, planned).
ESTIMATED = ("gemini-act",)
STATE_FIELDS = {"fp32": {}, "8-byte": {"optimizer_state_dtype": "bf16", "master_weights": False}}


def parse_shape(text: str) -> tuple[int, int]:
    """'16x2048' -> (16, 2048)."""
    try:
        batch, seq = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: expected batch x sequence length such as 16x2048, got {text!r}") from None
    if batch <= 0 or seq <= 0:
        raise SystemExit(f"--shapes: batch and sequence length must be positive, got {text!r}")
    return batch, seq


def predicted(model_name: str, batch: int, seq: int, budget: str | None, gpu_alone_s: float | None, args) -> dict:
    """gx.estimate of the row before it runs (the model on meta), or the error it raised. With the
    GPU-alone row measured, the GPU's rate is this model's there: the estimate's FLOPs of that same
    forward and backward (every block recomputed, no optimizer) over its measured time."""
    import gemini_ext as gx

    model = meta_model(model_name, seq)
    common = dict(tokens_per_step=batch * seq, seq_len=seq, loss_chunk_tokens=args.loss_chunk_tokens,
                  cpu_optimizer_elements_per_s=args.cpu_rate,
                  **({"device_bytes": args.device_bytes, "device_name": args.device_name} if args.smoke else {}))
    try:
        if gpu_alone_s:
            alone = gx.estimate(model, gx.GeminiConfig(placement_policy="auto", **STATE_FIELDS[args.state]), **common)
            gpu_flops = alone["step_parts_s"]["gpu"] * alone["rates"]["gpu_flops_per_s"]
            common["gpu_flops_per_s"] = gpu_flops / gpu_alone_s
        return estimate_row(model, budget, common, args)
    except Exception as exc:  # a plan that cannot fit raises; the row still runs and says so
        return {"error": f"{type(exc).__name__}: {exc}"}


def meta_model(model_name: str, seq: int):
    from hf_train import build_model

    return build_model(model_name, seq, "meta", hf_checkpointing=False)


def estimate_row(model, budget: str | None, common: dict, args) -> dict:
    """gx.estimate of `auto` with activations planned, and what it was made from."""
    import gemini_ext as gx

    config = gx.GeminiConfig(placement_policy="auto", max_norm=args.max_norm, gpu_memory_limit=budget,
                             activation_checkpointing="auto", activation_offload="auto", **STATE_FIELDS[args.state])
    e = gx.estimate(model, config, **common)
    return {"step_s": e["step_time_s"], "device_name": e["inputs"]["device_name"],
            **{k: e[k] for k in ("fits", "step_parts_s", "activation_plan", "rates", "plan", "device_bytes",
                                 "host_bytes", "pcie_bound_s", "lanes")}}


def reestimate(rows: list[dict], args) -> list[dict]:
    """Each engine row's estimate made again by this tree's gx.estimate from what the row's own
    estimate was made from (the machine's device and host bytes, its CPU rate and the GPU-alone
    rate): `estimate_now`, beside the estimate made before the row ran. The bound again too."""
    for row in rows:
        before = row.get("estimate") or {}
        if "rates" not in before:
            continue
        common = dict(tokens_per_step=row["batch"] * row["seq"], seq_len=row["seq"],
                      loss_chunk_tokens=args.loss_chunk_tokens,
                      cpu_optimizer_elements_per_s=before["rates"]["cpu_optimizer_elements_per_s"],
                      gpu_flops_per_s=before["rates"]["gpu_flops_per_s"],
                      device_bytes=before["fits"]["device_capacity_bytes"],
                      host_bytes=before["fits"]["host_available_bytes"],
                      device_name=before.get("device_name") or args.device_name)
        row["estimate_now"] = estimate_row(meta_model(row["model"], row["seq"]), row["budget"], common, args)
        alone = next((r.get("step_s_median") for r in rows if r.get("name") == "gpu-alone" and
                      (r["model"], r["batch"], r["seq"]) == (row["model"], row["batch"], row["seq"])), None)
        row["bound"] = bound(row, alone or (row.get("bound") or {}).get("gpu"))
    return rows


def record_of(row: dict, args) -> dict | None:
    """An engine row as tests/python/test_estimate_records.py holds the estimate to it: what the
    estimate is made from (the model's config, the tokens, the config, the machine), what the engine
    measured where the estimate predicts (the figures gx.estimate(recorded=...) takes), what it
    decided, and its step time. None for a row that did not train."""
    from hf_train import MODELS

    est, engine = row.get("estimate") or {}, row.get("engine") or {}
    if "step_s_median" not in row or "rates" not in est:
        return None
    placement = engine.get("placement") or {}
    decision = placement.get("decision") or {}
    acts = engine.get("activations") or {}
    plan, warm = acts.get("plan") or {}, acts.get("warm_up") or {}
    figures = {k: decision[k] for k in ("non_model_peak_bytes", "non_model_reserved_bytes", "device_other_bytes",
                                        "forward_seconds", "backward_seconds", "cpu_optimizer_elements_per_s",
                                        "h2d_bytes_per_s", "link_optimizer_elements_per_s") if k in decision}
    if "optimizer_window" in decision:
        figures["optimizer_steps_during_backward"] = decision["optimizer_window"] == "backward"
    figures.update({f"block0_{k}": warm[f"block0_{k}"] for k in ("activation_bytes", "input_bytes")
                    if f"block0_{k}" in warm})
    figures.update({k: plan[k] for k in ("host_free_bytes", "link_bytes_per_s") if k in plan})
    if "device_free_bytes" in plan:  # the room the plan was made in (the first iteration's figures)
        figures["activation_free_bytes"] = plan["device_free_bytes"]
    if "measured_blocks" in plan:
        figures["blocks"] = plan["measured_blocks"]
    cls, fields = MODELS[row["model"]]
    return {
        "model": row["model"], "model_config": [cls, fields], "batch": row["batch"], "seq": row["seq"],
        "config": {"gpu_memory_limit": row["budget"], "max_norm": args.max_norm, "activation_checkpointing": "auto",
                   "activation_offload": "auto", **STATE_FIELDS[args.state]},
        "loss_chunk_tokens": args.loss_chunk_tokens,
        "machine": {"device_bytes": est["fits"].get("device_total_bytes"), "device_name": est.get("device_name"),
                    "host_bytes": est["fits"]["host_available_bytes"],
                    "cpu_optimizer_elements_per_s": est["rates"]["cpu_optimizer_elements_per_s"],
                    "gpu_flops_per_s": est["rates"]["gpu_flops_per_s"]},
        "recorded": figures,
        "decided": {"chunk_budget_bytes": decision.get("chunk_budget_bytes"),
                    "optim_sets_on_device": placement.get("optim_chunks_on_device"),
                    "activation_plan": {c: plan.get(c) for c in ("keep", "recompute", "offload")},
                    "warm_up_chunk_budget_bytes": warm.get("chunk_budget_bytes")},
        "step_s": row["step_s_median"],
    }


def bound(row: dict, gpu_alone_s: float | None, rates: dict | None = None) -> dict:
    """The row's overlap bound: the longest of the GPU alone, the CPU's Adam over the host-held
    optimizer state and the copies of the busier direction, at the rates the engine probed (where
    its decision has none, parameters streamed, the estimate's: its CPU probe on the same host)."""
    engine = row.get("engine") or {}
    placement = engine.get("placement") or {}
    decision = placement.get("decision") or {}
    rates = rates or (row.get("estimate") or {}).get("rates") or {}  # the probes the estimate took on this machine
    cpu_rate = decision.get("cpu_optimizer_elements_per_s") or rates.get("cpu_optimizer_elements_per_s")
    link = decision.get("h2d_bytes_per_s") or rates.get("h2d_bytes_per_s")
    host_elements = (placement.get("optim_chunks_on_host") or 0) * (engine.get("chunk_size") or 0)
    traffic = engine.get("traffic") or {}
    per_step = max(traffic.get("h2d_bytes", 0), traffic.get("d2h_bytes", 0)) / max(1, row.get("steps", 1))
    parts = {"gpu": gpu_alone_s, "cpu": host_elements / cpu_rate if cpu_rate else None,
             "pcie": per_step / link if link else None}
    known = [v for v in parts.values() if v is not None]
    return {**parts, "bound": max(known) if known and gpu_alone_s is not None else None}


def cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def estimate_cell(est: dict, step: float) -> str:
    if "step_s" not in est:
        return est.get("error", "-")[:80]
    return f"{est['step_s']:.2f} ({(est['step_s'] - step) / step:+.0%})"


def lanes_cell(row: dict) -> str:
    """The lane that bounded the step, measured (engine.stats()["lanes"]) / estimated, and the
    largest error of the estimated lanes' busy seconds among the lanes busy 0.05 s or more."""
    measured = ((row.get("engine") or {}).get("lanes") or {})
    estimated = (row.get("estimate") or {}).get("lanes") or {}
    if not measured.get("bound") or not estimated.get("bound"):
        return "-"
    m, e = measured["busy_seconds"], estimated["busy_seconds"]
    errors = [abs(e[k] - m[k]) / m[k] for k in m if m[k] is not None and m[k] >= 0.05 and e.get(k) is not None]
    worst = f" ({max(errors):.0%})" if errors else ""
    return f"{measured['bound']} / {estimated['bound']}{worst}"


def table(rows: list[dict], peak_tflops: float) -> str:
    again = any("estimate_now" in r for r in rows)
    lines = ["| model | budget | tokens/step | system | step s | tokens/s | MFU | device peak GiB (chunks + torch "
             "allocated / + torch reserved) | host RSS GiB | "
             "bound s (GPU / CPU / PCIe) | x bound | estimate s (error) |" +
             (" estimate now s (error) |" if again else "") +
             " lanes' bound measured / estimated (worst lane error) | auto chose |",
             "|---" * (15 if again else 14) + "|"]
    for r in rows:
        head = (f"| {r['model']} | {r['budget'] or 'whole device'} | {r['batch'] * r['seq']:,} "
                f"({r['batch']} x {r['seq']}) | {hf_models.LABELS[r['name']]} |")
        if "step_s_median" not in r:
            lines.append(f"{head} {r.get('skipped') or r.get('error', '?')} |" + " |" * (9 + again))
            continue
        step, tokens = r["step_s_median"], r["batch"] * r["seq"]
        mfu = hf_models.row_mfu(r, tokens, peak_tflops) if peak_tflops else None
        chunks = ((r.get("engine") or {}).get("tier_bytes") or {}).get("device", {}).get("peak", 0)
        b, est = r.get("bound") or {}, r.get("estimate") or {}
        cells = [f"{step:.3f}", f"{tokens / step:,.0f}", "-" if mfu is None else f"{mfu:.1%}",
                 f"{((r.get('peak_torch_device_bytes') or 0) + chunks) / 2**30:.1f} / "
                 f"{((r.get('peak_torch_reserved_bytes') or 0) + chunks) / 2**30:.1f}",
                 f"{(r.get('peak_host_rss_bytes') or 0) / 2**30:.1f}",
                 " / ".join(cell(b.get(k), ".2f") for k in ("gpu", "cpu", "pcie")),
                 f"{step / b['bound']:.2f}" if b.get("bound") else "-", estimate_cell(est, step)] + (
            [estimate_cell(r.get("estimate_now") or {}, step)] if again else []) + [lanes_cell(r),
                                                                                     hf_models.auto_choice(r)]
        lines.append(head + " " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(rows: list[dict], args) -> str:
    if args.record:
        with open(args.record, "w") as f:
            json.dump([r for r in (record_of(row, args) for row in rows) if r is not None], f, indent=1)
    peak = None if args.smoke else args.peak_tflops  # sim has no peak: no MFU
    mfu = f"MFU against {peak:.0f} TFLOP/s" if peak else "no MFU on sim"
    return hf_models.save(f"{args.steps} steps, median after the first two, clipping {args.max_norm or 'off'}, "
                          f"{args.state} optimizer state, {mfu}\n\n" + table(rows, peak), rows, args.out)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama-7b", help="comma-separated names of bench/hf_train.py's MODELS")
    p.add_argument("--budgets", default="24GiB,40GiB,whole", help="comma-separated; 'whole': the whole device")
    p.add_argument("--shapes", default="4x2048,16x2048,32x2048,1x65536", help="comma-separated batch x seq")
    p.add_argument("--systems", default="gemini-act", help="comma-separated bench/hf_models.py systems per budget")
    p.add_argument("--state", choices=sorted(STATE_FIELDS), default="fp32",
                   help="gemini_ext's optimizer state: fp32 masters and moments, or the 8-byte state")
    p.add_argument("--no-gpu-alone", action="store_true", help="leave out the GPU-alone rows (no bound)")
    p.add_argument("--torch-alloc-conf", default="expandable_segments:True",
                   help="PYTORCH_CUDA_ALLOC_CONF of every row ('' leaves the environment's): expandable segments "
                        "keep torch's reserved memory near what it allocates")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--loss-chunk-tokens", type=int, default=8192)
    p.add_argument("--cpu-rate", type=float, default=None, help="the estimate's CPU Adam rate (default: measured)")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--timeout", type=int, default=300, help="seconds per row")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="a tiny Llama on sim, the estimate for an H100")
    p.add_argument("--reestimate", nargs="+", metavar="JSON", default=None,
                   help="no runs: the rows of these maps' JSON with every estimate made again by this tree "
                        "(--state, --max-norm and --loss-chunk-tokens as the runs had them)")
    p.add_argument("--record", default=None, metavar="JSON",
                   help="also write the engine rows as records the estimate's test holds it to "
                        "(tests/python/test_estimate_records.py)")
    p.add_argument("--device-name", default="H100",
                   help="--reestimate: the device whose peak the rows' estimates name, where they do not")
    args = p.parse_args(argv)
    args.device_bytes = "2GiB"  # the smoke run's estimate: no device here
    if args.smoke:
        args.models, args.budgets, args.shapes, args.steps, args.loss_chunk_tokens = "tiny-llama", "whole", "2x32", 3, 0
    unknown = {n.strip() for n in args.systems.split(",")} - set(hf_models.SYSTEMS)
    if unknown:
        p.error(f"--systems: unknown {sorted(unknown)}; choose from {list(hf_models.SYSTEMS)}")
    return args


def run(name: str, model: str, batch: int, seq: int, budget: str | None, args) -> dict:
    common = ["--model", model, "--batch", str(batch), "--seq", str(seq), "--steps", str(args.steps),
              "--max-norm", str(args.max_norm), "--loss-chunk-tokens", str(args.loss_chunk_tokens),
              "--state", args.state] + (["--device", "sim"] if args.smoke else [])
    why_not = hf_models.unavailable(name, args.smoke)
    row = {"skipped": why_not} if why_not else hf_models.run_row(name, common, budget, args.timeout)
    row.update(name=name, model=model, budget=budget, batch=batch, seq=seq)
    print(f"{model} {budget or 'whole device'} {batch}x{seq} {name}: " + (
        f"{row['step_s_median']:.3f} s/step" if "step_s_median" in row
        else row.get("skipped") or row.get("error", "?")),
        flush=True)
    return row


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.reestimate:
        rows = []
        for path in args.reestimate:
            with open(path) as f:
                rows += json.load(f)
        print(write(reestimate(rows, args), args))
        return rows
    budgets = [None if b.strip() == "whole" else b.strip() for b in args.budgets.split(",") if b.strip()]
    systems = [n.strip() for n in args.systems.split(",") if n.strip()]
    if args.torch_alloc_conf:  # every row's process, every system alike
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.torch_alloc_conf
    rows = []
    for model in (m.strip() for m in args.models.split(",") if m.strip()):
        for batch, seq in (parse_shape(s) for s in args.shapes.split(",") if s.strip()):
            alone = None if args.no_gpu_alone else run("gpu-alone", model, batch, seq, None, args)
            if alone is not None:
                rows.append(alone)
            for budget in budgets:
                estimate = predicted(model, batch, seq, budget, (alone or {}).get("step_s_median"), args)
                for name in systems:
                    row = run(name, model, batch, seq, budget, args)
                    if name in ESTIMATED:  # the configuration the estimate is made for
                        row["estimate"] = estimate
                        row["estimate_record"] = record_of(row, args)  # what the estimate's test holds it to
                    if name.startswith("gemini"):
                        row["bound"] = bound(row, (alone or {}).get("step_s_median"), estimate.get("rates"))
                    rows.append(row)
                    write(rows, args)  # after every row: a run cut short keeps what it measured
    print("\n" + write(rows, args))
    return rows


if __name__ == "__main__":
    main()
