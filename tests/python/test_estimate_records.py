"""gx.estimate against the engine's own runs on the GPU (bench/records/, `python -m bench PRESET`): the
map's engine rows (activations planned; each carries its `estimate_record`: what the estimate is made
from, what the engine measured where the estimate predicts, what it decided and its step time) and
the 4 x 2048 presets' engine rows (HF's checkpointing; the GPU's rate on the model from the GPU-alone
record of the same shape).

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

RECORDS = {os.path.basename(path): json.load(open(path))
           for path in sorted(glob.glob(os.path.join(REPO, "bench", "records", "*.json")))}
# The GPU alone per shape (batch, seq): the GPU's rate on the model where a row's record has none.
ALONE = {(row["batch"], row["seq"]): row["step_s"] for rec in RECORDS.values() for row in rec["rows"]
         if row.get("name") == "gpu-alone" and row.get("outcome") == "trained"}
# The map's engine rows carry what the estimate is made from (bench/hf_map.py's record_of); the
# 4 x 2048 presets' engine rows (bench/hf_models.py: HF's checkpointing, no activations planned) are
# made into the same form from what their record holds.
ROWS = [(source, i, row["estimate_record"] if row.get("estimate_record") else None)
        for source, rec in RECORDS.items() for i, row in enumerate(rec["rows"])
        if row.get("estimate_record") or (row.get("name") == "gemini" and row.get("outcome") == "trained"
                                          and (row["batch"], row["seq"]) in ALONE)]
STEP_TOLERANCE = 0.15  # of the measured step
BUDGET_TOLERANCE = 0.10  # of the engine's chunk budget, predicted
SETS_TOLERANCE = 3  # optimizer sets on the device, predicted
BLOCKS_TOLERANCE = 3  # blocks per choice (kept, recomputed, offloaded), predicted


def _record(source: str, index: int, given: dict | None) -> dict:
    """The row's estimate record: the map's as recorded, or one made from an hf_models row's record."""
    if given is not None:
        plan = ((RECORDS[source]["rows"][index].get("engine") or {}).get("activations") or {}).get("plan") or {}
        # recorded before the plan's own free bytes were kept
        if "device_free_bytes" in plan and "activation_free_bytes" not in given["recorded"]:
            given = {**given, "recorded": {**given["recorded"], "activation_free_bytes": plan["device_free_bytes"]}}
        return given
    import sys
    sys.path.insert(0, os.path.join(REPO, "bench"))
    from hf_train import MODELS

    rec = RECORDS[source]
    row = rec["rows"][index]
    decision = row["engine"]["placement"]["decision"]
    figures = {k: decision[k] for k in ("non_model_peak_bytes", "non_model_reserved_bytes", "device_other_bytes",
                                        "forward_seconds", "backward_seconds", "cpu_optimizer_elements_per_s",
                                        "h2d_bytes_per_s", "link_optimizer_elements_per_s") if k in decision}
    figures["optimizer_steps_during_backward"] = decision.get("optimizer_window") == "backward"
    return {
        "model": row["model"], "model_config": list(MODELS[row["model"]]), "batch": row["batch"], "seq": row["seq"],
        "config": {"gpu_memory_limit": row["budget"], "max_norm": row["max_norm"] or 0.0},
        "checkpointing": True, "loss_chunk_tokens": 0,  # HF's checkpointing and its own loss
        "machine": {"device_bytes": rec["machine"]["gpu_memory_bytes"], "device_name": rec["machine"]["gpu"],
                    "host_bytes": rec["machine"]["host_memory_bytes"],
                    "cpu_optimizer_elements_per_s": decision["cpu_optimizer_elements_per_s"]},
        "gpu_alone_s": ALONE[(row["batch"], row["seq"])],
        "recorded": figures,
        "decided": {"chunk_budget_bytes": decision["chunk_budget_bytes"],
                    "optim_sets_on_device": row["decided"]["optim_sets_on_device"],
                    "activation_plan": {c: None for c in ("keep", "recompute", "offload")}},
        "step_s": row["step_s"]}


def _estimate(row: dict, recorded: bool) -> dict:
    transformers = pytest.importorskip("transformers")
    cls, fields = row["model_config"]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, cls)(**fields, max_position_embeddings=row["seq"]))
    config = gx.GeminiConfig(placement_policy="auto", **row["config"])
    common = dict(tokens_per_step=row["batch"] * row["seq"], seq_len=row["seq"],
                  loss_chunk_tokens=row["loss_chunk_tokens"], checkpointing=row.get("checkpointing", True),
                  **row["machine"])
    if row.get("gpu_alone_s"):  # the GPU's rate on this model: the same forward and backward over its measured time
        alone = gx.estimate(model, gx.GeminiConfig(placement_policy="auto"), **common)
        flops = alone["step_parts_s"]["gpu"] * alone["rates"]["gpu_flops_per_s"]
        common["gpu_flops_per_s"] = flops / row["gpu_alone_s"]
    return gx.estimate(model, config, recorded=row["recorded"] if recorded else None, **common)


def _decided(e: dict) -> dict:
    plan = e["activation_plan"] or {}
    return {"chunk_budget_bytes": e["plan"]["chunk_budget_bytes"],
            "optim_sets_on_device": e["plan"]["optim_sets_on_device"],
            "activation_plan": {c: plan.get(c) for c in ("keep", "recompute", "offload")}}


def _name(row: dict) -> str:
    return f"{row['model']} {row['batch']}x{row['seq']} {row['config']['gpu_memory_limit'] or 'whole'}"


IDS = [f"{s}:{i}" for s, i, _ in ROWS]


@pytest.mark.parametrize("source,index,given", ROWS, ids=IDS)
def test_the_estimate_decides_as_the_engine_did_from_what_it_measured(source, index, given):
    row = _record(source, index, given)
    decided = _decided(_estimate(row, recorded=True))
    engine = {k: row["decided"][k] for k in decided}
    assert decided == engine, f"{source} row {index} ({_name(row)}): estimate {decided}, engine {engine}"


@pytest.mark.parametrize("source,index,given", ROWS, ids=IDS)
def test_the_estimate_predicts_the_step_and_the_decisions(source, index, given):
    row = _record(source, index, given)
    e = _estimate(row, recorded=False)
    error = (e["step_time_s"] - row["step_s"]) / row["step_s"]
    assert abs(error) <= STEP_TOLERANCE, f"{_name(row)}: {e['step_time_s']:.3f} s against {row['step_s']:.3f} s"
    predicted, engine = _decided(e), row["decided"]
    assert predicted["chunk_budget_bytes"] == pytest.approx(engine["chunk_budget_bytes"], rel=BUDGET_TOLERANCE)
    assert abs(predicted["optim_sets_on_device"] - engine["optim_sets_on_device"]) <= SETS_TOLERANCE, predicted
    for choice, count in engine["activation_plan"].items():
        if count is None:  # no activations planned
            assert predicted["activation_plan"][choice] is None, predicted
            continue
        assert abs(predicted["activation_plan"][choice] - count) <= BLOCKS_TOLERANCE, (predicted, engine)

