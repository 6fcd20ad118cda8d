"""gx.estimate against the engine's own runs: the engine rows of the map's presets, recorded on the
GPU by `python -m bench llama7b-map-...` (bench/records/*.json, each row's `estimate_record`: what the
estimate is made from, what the engine measured where the estimate predicts, what it decided and
its step time).

Two claims per row. Given the figures the engine measured (gx.estimate(recorded=...)), the estimate's
decisions are the engine's exactly: the same code decides (the placement policy, the warm-up budget,
the activations' room and the core's plan). From its own predictions, its step time is within 15% of
the measured step and its decisions are the engine's within the tolerances below."""

import glob
import json
import os

import pytest
import torch

import gemini_ext as gx
from conftest import REPO

RECORDS = sorted(glob.glob(os.path.join(REPO, "bench", "records", "*.json")))
ROWS = [(os.path.basename(path), i, row["estimate_record"]) for path in RECORDS
        for i, row in enumerate(json.load(open(path))["rows"]) if row.get("estimate_record")]
STEP_TOLERANCE = 0.15  # of the measured step
BUDGET_TOLERANCE = 0.10  # of the engine's chunk budget, predicted
SETS_TOLERANCE = 3  # optimizer sets on the device, predicted
BLOCKS_TOLERANCE = 3  # blocks per choice (kept, recomputed, offloaded), predicted


def _estimate(row: dict, recorded: bool) -> dict:
    transformers = pytest.importorskip("transformers")
    cls, fields = row["model_config"]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, cls)(**fields, max_position_embeddings=row["seq"]))
    config = gx.GeminiConfig(placement_policy="auto", activation_checkpointing="auto", activation_offload="auto",
                             **row["config"])
    machine = row["machine"]
    return gx.estimate(model, config, tokens_per_step=row["batch"] * row["seq"], seq_len=row["seq"],
                       loss_chunk_tokens=row["loss_chunk_tokens"], recorded=row["recorded"] if recorded else None,
                       **machine)


def _decided(e: dict) -> dict:
    plan = e["activation_plan"] or {}
    return {"chunk_budget_bytes": e["plan"]["chunk_budget_bytes"],
            "optim_sets_on_device": e["plan"]["optim_sets_on_device"],
            "activation_plan": {c: plan.get(c) for c in ("keep", "recompute", "offload")}}


def _name(row: dict) -> str:
    return f"{row['model']} {row['batch']}x{row['seq']} {row['config']['gpu_memory_limit'] or 'whole'}"


@pytest.mark.parametrize("source,index,row", ROWS, ids=[f"{s}:{_name(r)}" for s, _, r in ROWS])
def test_the_estimate_decides_as_the_engine_did_from_what_it_measured(source, index, row):
    decided = _decided(_estimate(row, recorded=True))
    engine = {k: row["decided"][k] for k in decided}
    assert decided == engine, f"{source} row {index} ({_name(row)}): estimate {decided}, engine {engine}"


@pytest.mark.parametrize("source,index,row", ROWS, ids=[f"{s}:{_name(r)}" for s, _, r in ROWS])
def test_the_estimate_predicts_the_step_and_the_decisions(source, index, row):
    e = _estimate(row, recorded=False)
    error = (e["step_time_s"] - row["step_s"]) / row["step_s"]
    assert abs(error) <= STEP_TOLERANCE, f"{_name(row)}: {e['step_time_s']:.3f} s against {row['step_s']:.3f} s"
    predicted, engine = _decided(e), row["decided"]
    assert predicted["chunk_budget_bytes"] == pytest.approx(engine["chunk_budget_bytes"], rel=BUDGET_TOLERANCE)
    assert abs(predicted["optim_sets_on_device"] - engine["optim_sets_on_device"]) <= SETS_TOLERANCE, predicted
    for choice, count in engine["activation_plan"].items():
        assert abs(predicted["activation_plan"][choice] - count) <= BLOCKS_TOLERANCE, (predicted, engine)

