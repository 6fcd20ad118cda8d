"""The tables of README.md and docs/BENCHMARKS.md, made from bench/records/ (bench/records.py): each
table sits between a `<!-- table NAME -->` line and an `<!-- end table -->` line, and
`python -m bench tables` writes it from the records of the presets it names; `--check` says which
differ instead (tests/python/test_bench_tables.py runs it). A row whose preset has no record says so,
with the command that makes it: no figure is typed by hand."""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import sys

import records

GIB = 2**30
FILES = {"README.md": os.path.join(records.REPO, "README.md"),
         "docs/BENCHMARKS.md": os.path.join(records.REPO, "docs", "BENCHMARKS.md")}
NOT_RECORDED = "not recorded on this tree"


@dataclasses.dataclass(frozen=True)
class Line:
    """One README line: the engine row of `preset` at `budget` (None: the whole device) and `shape`."""
    shape: tuple[int, int]
    budget: str | None
    setting: str
    preset: str
    system: str = "gemini"
    peers: tuple = ()  # (preset, system) rows at the same budget and shape, measured on the same machine
    alone: tuple = ("llama7b-gpu-alone", "gpu-alone")  # the GPU alone at this shape: (preset, system)


_PEERS_CLIP = (("llama7b-fsdp2-clip", "fsdp2-offload"), ("llama7b-deepspeed-24g-clip", "deepspeed-offload-optim"))


def _map_lines(shape, budgets, map_preset):
    return [Line(shape, b, setting, map_preset, system, alone=(map_preset, "gpu-alone"))
            for b in budgets for setting, system in (("activations planned over HF's checkpointing", "gemini-hf-act"),
                                                      ("activations planned by the engine", "gemini-act"))]


README_LINES = [
    *(Line((4, 2048), b, setting, preset, peers=_PEERS_CLIP if preset == "llama7b-clip-every-step" else ())
      for b in ("24GiB", "40GiB", None)
      for setting, preset in (("no clipping", "llama7b-no-clip"), ("the norm within 1.0", "llama7b-clip-within-norm"),
                              ("every step clips", "llama7b-clip-every-step"))),
    *_map_lines((16, 2048), ("24GiB", "40GiB", None), "llama7b-map-16x2048"),
    *_map_lines((32, 2048), ("24GiB", "40GiB", None), "llama7b-map-32x2048"),
    *_map_lines((1, 65536), ("24GiB", None), "llama7b-map-65536"),
]


def _find(recs: dict, preset: str, system: str, budget: str | None, shape: tuple[int, int]) -> dict | None:
    rec = recs.get(preset)
    if rec is None:
        return None
    for r in rec["rows"]:
        if r.get("name") == system and (r.get("batch"), r.get("seq")) == shape and (
                system == "gpu-alone" or r.get("budget") == budget):
            return r
    return None


def _step(r: dict) -> str:
    if r.get("outcome") != "trained":
        return f"{r.get('outcome', '?')}: {r.get('why', '?')}"[:120].replace("|", "/")
    mfu = f", {r['mfu']:.1%} MFU" if r.get("mfu") is not None else ""
    return f"{r['step_s']:.2f}{mfu}"


def _peak(r: dict) -> str:
    """The chunks' peak plus torch's reserved peak, against the budget where there is one."""
    if r.get("outcome") != "trained" or r.get("torch_reserved_peak_bytes") is None:
        return "-"
    used = (r.get("device_chunk_peak_bytes") or 0) + r["torch_reserved_peak_bytes"]
    over = "" if r.get("within_budget", True) else " **over the budget**"
    return f"{used / GIB:.1f}{over}"


def _label(budget: str | None) -> str:
    return budget.replace("GiB", " GiB") if budget else "whole GPU"


def readme_llama7b(recs: dict) -> str:
    lines = ["| tokens per step | budget | setting | gemini_ext s/step | x GPU alone | device peak GiB | "
             "peers s/step, same machine | command |", "|---|---|---|---|---|---|---|---|"]
    used, missing = set(), {}
    for ln in README_LINES:
        r = _find(recs, ln.preset, ln.system, ln.budget, ln.shape)
        alone = _find(recs, *ln.alone, None, ln.shape)
        head = f"| {ln.shape[0]} x {ln.shape[1]} | {_label(ln.budget)} | {ln.setting} |"
        command = f"`python -m bench {ln.preset}`"
        if r is None:  # one line per preset: its budgets and settings, and the command that records them
            if ln.preset not in missing:
                missing[ln.preset] = (len(lines), [], [])
                lines.append(None)
            _, budgets, settings = missing[ln.preset]
            budgets += [] if _label(ln.budget) in budgets else [_label(ln.budget)]
            settings += [] if ln.setting in settings else [ln.setting]
            lines[missing[ln.preset][0]] = (f"| {ln.shape[0]} x {ln.shape[1]} | {', '.join(budgets)} | "
                                            f"{'; '.join(settings)} | {NOT_RECORDED} | | | | {command} |")
            continue
        used.add(ln.preset)
        x = f"{r['step_s'] / alone['step_s']:.2f}" if alone and alone.get("outcome") == "trained" and \
            r.get("outcome") == "trained" else "-"
        if alone:
            used.add(ln.alone[0])
        peers = []
        for preset, system in ln.peers:
            p = _find(recs, preset, system, ln.budget, ln.shape)
            if p is not None:
                used.add(preset)
                peers.append(f"{hf_label(system)} {_step(p)}")
        lines.append(f"{head} **{_step(r)}** | {x} | {_peak(r)} | {'; '.join(peers)} | {command} |")
    return "\n".join(lines) + "\n\n" + provenance(recs, sorted(used))


def hf_label(system: str) -> str:
    import hf_models

    return hf_models.LABELS.get(system, system)


def provenance(recs: dict, names: list[str]) -> str:
    """Which machines and dates the figures above come from, and which records are older than the engine."""
    if not names:
        return "No row above is recorded yet: each command writes its record to bench/records/."
    now = records.engine_digest()
    machines = {}
    for n in names:
        m = recs[n]["machine"]
        key = (f"{m.get('gpu') or 'no GPU'} ({(m.get('gpu_memory_bytes') or 0) / GIB:.0f} GiB), {m.get('host_cores')} "
               f"cores, {(m.get('host_memory_bytes') or 0) / GIB:.0f} GiB host, torch {m.get('torch')}")
        machines.setdefault(key, set()).add(recs[n]["date"])
    text = "Measured on " + "; ".join(f"{k} ({', '.join(sorted(d))})" for k, d in sorted(machines.items())) + \
        "; records in bench/records/."
    stale = [n for n in names if recs[n]["tree"]["engine_sha256"] != now]
    if stale:
        text += " Made with an earlier engine than this tree's: " + ", ".join(f"`{n}`" for n in stale) + "."
    return text


def _per_preset(recs: dict, names: list[str], columns: list[str], missing_at: int, lines_of) -> str:
    """A table over presets: each recorded preset's lines (`lines_of(name, record)`), or for one without a
    record a line saying so in column `missing_at`; then where the figures come from."""
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    used = []
    for name in names:
        rec = recs.get(name)
        if rec is None:
            cells = [f"`{name}`"] + [""] * (len(columns) - 1)
            cells[missing_at] = NOT_RECORDED
            lines.append("|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
            continue
        used.append(name)
        lines += lines_of(name, rec)
    return "\n".join(lines) + "\n\n" + provenance(recs, used)


def benchmarks_4k(recs: dict) -> str:
    """Every row of the 4 x 2048 presets, engine and peers, with what the engine chose."""
    names = ["llama7b-gpu-alone", "llama7b-no-clip", "llama7b-clip-within-norm", "llama7b-clip-every-step",
             "llama7b-fsdp2-clip", "llama7b-deepspeed-24g-clip"]
    columns = ["preset", "budget", "system", "step s", "tokens/s", "MFU", "device peak GiB (chunks + torch reserved)",
               "host RSS peak GiB", "H2D GB/step", "steps clipped", "auto chose"]
    return _per_preset(recs, names, columns, 3, lambda name, rec: [_detail(name, r) for r in rec["rows"]])


def _detail(name: str, r: dict) -> str:
    head = f"| `{name}` | {_label(r.get('budget'))} | {hf_label(r.get('name', '?'))} |"
    if r.get("outcome") != "trained":
        return f"{head} {_step(r)} | | | | | | | |"
    h2d = r.get("h2d_bytes_per_step")
    rss = r.get("host_rss_peak_bytes")
    clipped = f"{r['clipped_steps']}/{len(r['grad_norms'])}" if r.get("max_norm") and r.get("grad_norms") else "-"
    return (f"{head} {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
            f"{'-' if r.get('mfu') is None else format(r['mfu'], '.1%')} | {_peak(r)} | "
            f"{'-' if rss is None else format(rss / GIB, '.1f')} | "
            f"{'-' if h2d is None else format(h2d / 1e9, '.1f')} | "
            f"{clipped} | {chose(r)} |")


def chose(r: dict) -> str:
    d = r.get("decided") or {}
    if not d:
        return ""
    text = f"optimizer sets {d.get('optim_sets_on_device', '?')} device / {d.get('optim_sets_on_host', '?')} host"
    if d.get("optim_sets_link_lane"):
        text += f" ({d['optim_sets_link_lane']} via the link)"
    plan = d.get("activation_plan")
    if plan:
        text += f"; blocks {plan['keep']} kept / {plan['recompute']} recomputed / {plan['offload']} offloaded"
    return text


def _estimate(predicted: float | None, measured: float) -> str:
    return "-" if predicted is None else f"{predicted:.2f} ({(predicted - measured) / measured:+.0%})"


def benchmarks_map(recs: dict) -> str:
    """The activation rows: per shape the GPU alone and each budget, with the estimate made before the row."""
    names = ["llama7b-map-16x2048", "llama7b-map-32x2048", "llama7b-map-65536"]
    columns = ["preset", "budget", "tokens/step", "system", "step s", "MFU", "x GPU alone",
               "device peak GiB (chunks + torch reserved)", "host RSS peak GiB", "estimate s (error)", "auto chose"]
    return _per_preset(recs, names, columns, 4, lambda name, rec: [_map_line(recs, name, r) for r in rec["rows"]])


def _map_line(recs: dict, name: str, r: dict) -> str:
    alone = _find(recs, name, "gpu-alone", None, (r.get("batch"), r.get("seq")))
    head = (f"| `{name}` | {_label(r.get('budget')) if r.get('name') != 'gpu-alone' else '-'} | "
            f"{r['tokens_per_step']:,} ({r['batch']} x {r['seq']}) | {hf_label(r.get('name', '?'))} |")
    if r.get("outcome") != "trained":
        return f"{head} {_step(r)} | | | | | | |"
    est = (r.get("estimate") or {}).get("step_s")
    x = r["step_s"] / alone["step_s"] if alone and alone.get("outcome") == "trained" else None
    rss = r.get("host_rss_peak_bytes")
    return (f"{head} {r['step_s']:.3f} | {'-' if r.get('mfu') is None else format(r['mfu'], '.1%')} | "
            f"{'-' if x is None else format(x, '.2f')} | {_peak(r)} | "
            f"{'-' if rss is None else format(rss / GIB, '.1f')} | {_estimate(est, r['step_s'])} | {chose(r)} |")


def benchmarks_rl(recs: dict) -> str:
    """The RL presets' iterations: generation, the training step and what settles after it, the weight
    stream, offload and reload, the next step (bench/rl_phases.py's figures)."""
    names = ["llama7b-rl-phases-40g", "llama7b-rl-phases-40g-8byte"]
    columns = ["preset", "iteration", "generate s (tokens/s, s per token step)", "train s + settle s",
               "stream s (x link)", "offload s", "reload s", "next step s"]
    return _per_preset(recs, names, columns, 2, _rl_lines)


def _rl_lines(name: str, rec: dict) -> list[str]:
    phases = rec["rows"][0].get("phases") or {}
    new = phases.get("new") or 1
    lines = []
    for r in phases.get("rows") or []:
        link = f" ({r['stream_s'] / r['stream_link_s']:.1f}x)" if r.get("stream_link_s") else ""
        lines.append(f"| `{name}` | {r['iteration']} | {r['generate_s']:.2f} ({r['tokens'] / r['generate_s']:.0f}, "
                     f"{r['generate_s'] / new:.3f}) | {r['train_s']:.2f} + {r.get('settle_s', 0.0):.2f} | "
                     f"{r['stream_s']:.2f}{link} | {r['offload_s']:.2f} | {r['reload_s']:.2f} | "
                     f"{r['train_after_reload_s']:.2f} |")
    return lines


def benchmarks_grpo(recs: dict) -> str:
    """TRL's GRPOTrainer per system: generation, scoring, both with TRL's log-probabilities, and the whole
    step, medians over the iterations after the first, against the floor (bench/trl_grpo.py's figures)."""
    columns = ["preset", "system", "generate s (new tokens/s)", "score s", "generate and score s", "step s",
               "x alone"]
    return _per_preset(recs, ["llama7b-trl-grpo-40g"], columns, 1, _grpo_lines)


def _grpo_lines(name: str, rec: dict) -> list[str]:
    def median(values):
        timed = values[1:] or values
        return statistics.median(timed) if timed else None

    seconds = {r["name"]: (r.get("phases") or {}).get("seconds") for r in rec["rows"]}
    floor = median((seconds.get("plain") or {}).get("step") or [])
    lines = []
    for r in rec["rows"]:
        if r.get("outcome") != "measured":
            lines.append(f"| `{name}` | {r['name']} | {r.get('why') or r.get('outcome')} | | | | |")
            continue
        m = {k: median(v) for k, v in r["phases"]["seconds"].items()}
        new = r["phases"]["new_tokens_per_step"]
        x = f"{m['step'] / floor:.2f}" if floor else "-"
        lines.append(f"| `{name}` | {r['name']} | {m['generate']:.2f} ({new / m['generate']:.0f}) | {m['score']:.3f} | "
                     f"{m['generate_and_score']:.2f} | {m['step']:.2f} | {x} |")
    return lines


TABLES = {"llama7b": (("README.md",), readme_llama7b), "llama7b-4k": (("docs/BENCHMARKS.md",), benchmarks_4k),
          "llama7b-map": (("docs/BENCHMARKS.md",), benchmarks_map),
          "llama7b-rl": (("docs/BENCHMARKS.md",), benchmarks_rl),
          "llama7b-grpo": (("docs/BENCHMARKS.md",), benchmarks_grpo)}
BLOCK = re.compile(r"(<!-- table (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)


def render(text: str, recs: dict) -> str:
    """`text` with each table block's body made again from `recs`."""
    def one(m):
        name = m.group("name")
        if name not in TABLES:
            raise SystemExit(f"a `<!-- table {name} -->` block names no table of bench/tables.py ({list(TABLES)})")
        return m.group(1) + TABLES[name][1](recs) + "\n" + m.group(4)
    return BLOCK.sub(one, text)


def differing(recs: dict | None = None) -> list[str]:
    """The files whose tables differ from what the records make."""
    recs = records.load_all() if recs is None else recs
    out = []
    for name, path in FILES.items():
        with open(path) as f:
            text = f.read()
        if render(text, recs) != text:
            out.append(name)
    return out


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print("python -m bench tables [--check]", file=sys.stderr)
        return 2
    recs = records.load_all()
    if argv == ["--check"]:
        stale = differing(recs)
        for name in stale:
            print(f"{name}: its tables differ from bench/records/; `python -m bench tables` writes them")
        return 1 if stale else 0
    for name, path in FILES.items():
        with open(path) as f:
            text = f.read()
        new = render(text, recs)
        if new != text:
            with open(path, "w") as f:
                f.write(new)
            print(f"{name}: tables written from bench/records/")
    return 0
