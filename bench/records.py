"""Records: what one preset of `python -m bench` measured, kept in bench/records/<preset>.json so
that the tables of README.md and docs/BENCHMARKS.md are made from them (bench/tables.py) and the
estimate is held to them (tests/python/test_estimate_records.py), no figure typed by hand.

A record holds the preset's name and command, the date, the machine (GPU, driver, host cores and
memory, torch and transformers), the tree (its commit and a digest of the engine's own sources,
gemini_ext/ and csrc/, so that a record made before the engine changed can be told apart) and one
row per system the runner ran: its inputs (model, budget, tokens), step time, tokens/s, MFU, the
device peaks of the chunks and of torch's allocated and reserved memory against the budget, the
host's peak, the engine's decisions, and for the map's engine rows what the estimate is checked
against (bench/hf_map.py's `record_of`). A row that failed or was skipped keeps its cause."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DIRECTORY = os.path.join(HERE, "records")
ENGINE_SOURCES = ("gemini_ext", "csrc")  # what a record's figures depend on (bench/ only runs them)
ENGINE_SUFFIXES = (".py", ".h", ".cpp", ".cu", ".cuh", ".inc")


def engine_digest(repo: str = REPO) -> str:
    """sha256 over the engine's own sources (path and contents, sorted): equal digests, equal engine."""
    h = hashlib.sha256()
    for top in ENGINE_SOURCES:
        for root, dirs, files in os.walk(os.path.join(repo, top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(ENGINE_SUFFIXES) and name != "built_for.py":  # built_for.py: written by the build
                    path = os.path.join(root, name)
                    h.update(os.path.relpath(path, repo).encode() + b"\0")
                    with open(path, "rb") as f:
                        h.update(f.read() + b"\0")
    return h.hexdigest()


def tree(repo: str = REPO) -> dict:
    """The commit the record was made on, whether the engine's sources differed from it, their digest."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    changed = git("status", "--porcelain", "--", *ENGINE_SOURCES)
    return {"commit": git("rev-parse", "HEAD") or None, "engine_changed_since_commit": bool(changed),
            "engine_sha256": engine_digest(repo)}


def machine() -> dict:
    """The GPU (name, memory, driver), the host (cores, memory) and the software the figures came from."""
    import torch

    from gemini_ext.placement.host_memory import mem_total_bytes

    facts = {"host_cores": os.cpu_count(), "host_memory_bytes": mem_total_bytes(),
             "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    import importlib.metadata
    for package in ("transformers", "deepspeed"):  # the peers' and the models' libraries, where installed
        try:
            facts[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        facts.update(gpu=p.name, gpu_memory_bytes=p.total_memory, gpus=torch.cuda.device_count())
        try:
            facts["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                             capture_output=True, text=True, timeout=30).stdout.split()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            pass
    else:
        facts["gpu"] = None
    return facts


def budget_bytes(text: str | None) -> int | None:
    """'40GiB' -> 42949672960; None (the whole device) -> None."""
    if not text:
        return None
    from gemini_ext._units import parse_bytes

    return parse_bytes(text, "budget")


def row(raw: dict, peak_tflops: float | None) -> dict:
    """One runner row (bench/hf_train.py's summary as bench/hf_models.py and bench/hf_map.py list it)
    as the record keeps it."""
    out = {k: raw.get(k) for k in ("name", "model", "budget") if k in raw}
    batch = raw.get("batch")
    seq = raw.get("seq", raw.get("seq_len"))
    tokens = raw.get("tokens_per_step") or (batch * seq if batch and seq else None)
    out.update(batch=batch, seq=seq, tokens_per_step=tokens, budget_bytes=budget_bytes(raw.get("budget")))
    if "phases" in raw:  # rl_phases: its iterations' phases as the runner measured them
        out.update(outcome="measured", phases=raw["phases"])
        return out
    if "step_s_median" not in raw:
        out["outcome"] = "skipped" if raw.get("skipped") else "failed"
        out["why"] = raw.get("skipped") or raw.get("error") or "no step time"
        return out
    engine = raw.get("engine") or {}
    step = raw["step_s_median"]
    active = raw.get("active_parameters") or raw.get("parameters")
    chunks = ((engine.get("tier_bytes") or {}).get("device") or {}).get("peak")
    reserved = raw.get("peak_torch_reserved_bytes")
    placement = engine.get("placement") or {}
    acts = (engine.get("activations") or {}).get("plan") or {}
    traffic = engine.get("traffic") or {}
    out.update(
        outcome="trained", system=raw.get("system"), parameters=raw.get("parameters"), active_parameters=active,
        steps=raw.get("steps"), step_s=step, step_seconds=raw.get("step_seconds"), setup_s=raw.get("setup_s"),
        tokens_per_s=tokens / step if tokens else None,
        mfu=6 * active * tokens / step / (peak_tflops * 1e12) if peak_tflops and active and tokens else None,
        max_norm=raw.get("max_norm"), loss_scale=raw.get("loss_scale"), grad_norms=raw.get("grad_norms"),
        clipped_steps=sum(n > raw["max_norm"] for n in raw.get("grad_norms") or []) if raw.get("max_norm") else 0,
        losses=raw.get("losses"),
        device_chunk_peak_bytes=chunks, torch_allocated_peak_bytes=raw.get("peak_torch_device_bytes"),
        torch_reserved_peak_bytes=reserved, host_rss_peak_bytes=raw.get("peak_host_rss_bytes"),
        h2d_bytes_per_step=traffic["h2d_bytes"] / raw["steps"] if "h2d_bytes" in traffic and raw.get("steps") else None)
    if out["budget_bytes"] is not None and reserved is not None:
        # the figure a limit must cover: the chunks and what torch's allocator held, each at its peak
        out["within_budget"] = (chunks or 0) + reserved <= out["budget_bytes"]
    if engine:
        out["decided"] = {
            "optim_sets_on_device": placement.get("optim_chunks_on_device"),
            "optim_sets_on_host": placement.get("optim_chunks_on_host"),
            "optim_sets_link_lane": placement.get("optim_chunks_link_lane"),
            "chunk_budget_bytes": (placement.get("decision") or {}).get("chunk_budget_bytes"),
            "activation_plan": {c: acts.get(c) for c in ("keep", "recompute", "offload")} if acts.get("decided")
            else None}
        out["engine"] = engine  # the engine's own stats(), for what a table does not show
    for key in ("estimate", "bound", "estimate_record"):
        if raw.get(key) is not None:
            out[key] = raw[key]
    return out


def rows_of(runner: str, result) -> list[dict]:
    """The runner's JSON output as raw rows: hf_models and hf_map list theirs; rl_phases writes one
    summary of its iterations, kept whole as one row."""
    if runner == "rl_phases":
        return [{"name": "rl-phases", "model": result.get("model"), "budget": result.get("budget"), "phases": result}]
    return list(result)


def make(preset_name: str, command: list[str], reproduces: str, raw_rows: list[dict], peak_tflops: float | None,
         when: datetime.date | None = None) -> dict:
    return {"preset": preset_name, "command": "python -m bench " + preset_name, "runs": " ".join(command),
            "reproduces": reproduces, "date": (when or datetime.date.today()).isoformat(), "machine": machine(),
            "tree": tree(), "peak_tflops": peak_tflops, "rows": [row(r, peak_tflops) for r in raw_rows]}


def path_of(preset_name: str, directory: str = DIRECTORY) -> str:
    return os.path.join(directory, preset_name + ".json")


def save(record: dict, directory: str = DIRECTORY) -> str:
    os.makedirs(directory, exist_ok=True)
    path = path_of(record["preset"], directory)
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=str)
        f.write("\n")
    return path


def load(preset_name: str, directory: str = DIRECTORY) -> dict | None:
    path = path_of(preset_name, directory)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def load_all(directory: str = DIRECTORY) -> dict[str, dict]:
    if not os.path.isdir(directory):
        return {}
    return {name[:-5]: load(name[:-5], directory) for name in sorted(os.listdir(directory)) if name.endswith(".json")}


def main(argv: list[str]) -> int:
    """`python -m bench records`: each record's machine and date, and whether the engine's sources
    are still those it was made with."""
    if argv:
        print("python -m bench records: takes no arguments", flush=True)
        return 2
    now = engine_digest()
    for name, rec in load_all().items():
        m, t = rec["machine"], rec["tree"]
        same = "this engine" if t["engine_sha256"] == now else "an earlier engine: run it again"
        print(f"{name:34s} {rec['date']}  {m.get('gpu') or 'no GPU'}  {(t.get('commit') or '?')[:10]}  {same}")
    return 0
