"""The benchmark tables of README.md and docs/BENCHMARKS.md are made from bench/records/ and from
nothing else (bench/tables.py): what the files hold is what the records make, a record's rows land
in the table's cells, and a record made with another engine is named as such."""

import os
import sys

import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import records  # noqa: E402
import tables  # noqa: E402


def test_the_tables_in_the_readme_and_benchmarks_are_what_the_records_make():
    assert tables.differing() == [], "run `python -m bench tables` and commit what it writes"


def _raw(name, budget, step, **extra):
    """A runner row as bench/hf_train.py writes it (the figures a table reads)."""
    row = {"name": name, "model": "llama-7b", "budget": budget, "batch": 4, "seq_len": 2048, "tokens_per_step": 8192,
           "parameters": 6_738_415_616, "steps": 7, "step_s_median": step, "max_norm": 1.0, "grad_norms": [2.0] * 7,
           "peak_torch_device_bytes": 10 << 30, "peak_torch_reserved_bytes": 12 << 30,
           "peak_host_rss_bytes": 100 << 30}
    row.update(extra)
    return row


def _record(preset, rows, digest=None):
    rec = records.make(preset, ["bench/hf_models.py"], "test", rows, peak_tflops=989.0)
    rec["machine"] = {"gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_bytes": 80 << 30, "host_cores": 16,
                      "host_memory_bytes": 125 << 30, "torch": "2.11.0+cu130"}
    if digest:
        rec["tree"]["engine_sha256"] = digest
    return rec


def test_a_records_rows_land_in_the_readme_table_with_their_ratio_to_the_gpu_alone_and_the_peers():
    engine = {"tier_bytes": {"device": {"peak": 20 << 30}}, "traffic": {"h2d_bytes": 7 * 15e9},
              "placement": {"optim_chunks_on_device": 8, "optim_chunks_on_host": 37, "decision": {}}}
    recs = {"llama7b-clip-every-step": _record("llama7b-clip-every-step", [
                _raw("gemini", "40GiB", 1.6, engine=engine),
                _raw("gemini", "24GiB", 2.0, engine=engine, peak_torch_reserved_bytes=5 << 30)]),
            "llama7b-gpu-alone": _record("llama7b-gpu-alone", [_raw("gpu-alone", None, 0.8)]),
            "llama7b-fsdp2-clip": _record("llama7b-fsdp2-clip", [
                _raw("fsdp2-offload", "40GiB", 6.4), {"name": "fsdp2-offload", "model": "llama-7b", "budget": "24GiB",
                                                      "batch": 4, "seq_len": 2048, "error": "timed out after 300 s"}],
                digest="0" * 64)}
    text = tables.readme_llama7b(recs)
    lines = {(ln.split(" | ")[1], ln.split(" | ")[2]): ln for ln in text.splitlines() if ln.startswith("| 4 x 2048")}
    row = lines[("40 GiB", "every step clips")]
    # 6 N tokens / step / peak: 6 * 6.74e9 * 8192 / 1.6 / 989e12 = 20.9%; 1.6 / 0.8 = 2.00x the GPU alone;
    # 20 GiB of chunks + 12 GiB reserved by torch = 32 GiB, within the 40 GiB budget
    assert "**1.60, 20.9% MFU** | 2.00 | 32.0 | FSDP2 + CPU offload 6.40, 5.2% MFU |" in row, row
    over = lines[("24 GiB", "every step clips")]
    assert "25.0 **over the budget**" in over and "failed: timed out after 300 s" in over, over
    missing = lines[("24 GiB, 40 GiB, whole GPU", "no clipping")]  # a preset without a record: one line, its command
    assert "not recorded on this tree" in missing and "`python -m bench llama7b-no-clip`" in missing
    assert "`llama7b-fsdp2-clip`" in text.split("earlier engine")[1], "a record of another engine is named"


def test_a_record_keeps_what_the_map_and_the_estimates_test_read():
    raw = _raw("gemini-act", "24GiB", 4.4, batch=16, seq=2048, tokens_per_step=32768,
               estimate={"step_s": 4.0}, estimate_record={"step_s": 4.4},
               engine={"activations": {"plan": {"decided": True, "keep": 0, "recompute": 25, "offload": 7}}})
    row = records.row(raw, 989.0)
    assert row["outcome"] == "trained" and row["tokens_per_step"] == 32768 and row["budget_bytes"] == 24 << 30
    assert row["decided"]["activation_plan"] == {"keep": 0, "recompute": 25, "offload": 7}
    assert row["estimate_record"] == {"step_s": 4.4} and row["within_budget"]
    iteration = {"iteration": 0, "tokens": 2048, "generate_s": 25.6, "train_s": 0.99, "settle_s": 0.1,
                 "stream_s": 3.7, "stream_link_s": 0.25, "offload_s": 0.08, "reload_s": 0.0,
                 "train_after_reload_s": 1.09}
    rl = records.rows_of("rl_phases", {"model": "llama-7b", "budget": "40GiB", "new": 256, "rows": [iteration]})
    assert records.row(rl[0], 989.0)["phases"]["rows"] == [iteration]
    rec = _record("llama7b-rl-phases-40g", rl)
    line = tables.benchmarks_rl({"llama7b-rl-phases-40g": rec}).splitlines()[2]
    # 2,048 tokens in 25.6 s: 80 tokens/s, 0.100 s per token step of 256; the stream 14.8x the link's time
    assert line == ("| `llama7b-rl-phases-40g` | 0 | 25.60 (80, 0.100) | 0.99 + 0.10 | 3.70 (14.8x) | 0.08 | 0.00 "
                    "| 1.09 |")
    assert records.row({"name": "gemini", "skipped": "needs a CUDA device"}, None)["outcome"] == "skipped"
    # bench/trl_grpo.py's rows: per system every iteration's phases; the table's medians skip the first
    clock = {"generate": [9.0, 4.0, 5.0], "score": [0.01] * 3, "generate_and_score": [10.0, 5.0, 6.0],
             "step": [12.0, 7.0, 9.0]}
    grpo = [{"name": "gemini", "phases": {"new_tokens_per_step": 2048, "seconds": clock}},
            {"name": "plain", "phases": {"new_tokens_per_step": 2048, "seconds": {**clock, "step": [9, 4, 4]}}},
            {"name": "deepspeed", "skipped": "deepspeed is not importable here"}]
    rec = _record("llama7b-trl-grpo-40g", records.rows_of("trl_grpo", grpo))
    lines = tables.benchmarks_grpo({"llama7b-trl-grpo-40g": rec}).splitlines()[2:5]
    # the engine: generation 4.5 s (455 new tokens/s), step 8.0 s against the floor's 4.0 s
    assert lines[0] == "| `llama7b-trl-grpo-40g` | gemini | 4.50 (455) | 0.010 | 5.50 | 8.00 | 2.00 |", lines
    assert lines[2] == "| `llama7b-trl-grpo-40g` | deepspeed | deepspeed is not importable here | | | | |", lines


def test_render_replaces_only_the_named_blocks_and_refuses_an_unknown_one():
    text = "before\n<!-- table llama7b -->\nold figures\n<!-- end table -->\nafter\n"
    out = tables.render(text, {})
    assert out.startswith("before\n<!-- table llama7b -->\n| tokens per step |") and out.endswith(
        "<!-- end table -->\nafter\n") and "old figures" not in out
    assert tables.render(out, {}) == out
    with pytest.raises(SystemExit, match="no-such"):
        tables.render("<!-- table no-such -->\n<!-- end table -->", {})


def test_the_engine_digest_follows_the_engines_sources_only(tmp_path):
    for top in ("gemini_ext", "csrc", "bench"):
        (tmp_path / top).mkdir()
        (tmp_path / top / "a.py").write_text("x = 1\n")
    before = records.engine_digest(str(tmp_path))
    (tmp_path / "bench" / "a.py").write_text("x = 2\n")
    assert records.engine_digest(str(tmp_path)) == before, "bench/ runs the engine; it is not the engine"
    (tmp_path / "csrc" / "a.py").write_text("x = 2\n")
    assert records.engine_digest(str(tmp_path)) != before
