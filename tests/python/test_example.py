"""The README's main job stays runnable: the example trains and prints its summary."""

import json

import pytest

from conftest import run_python


def test_train_gpt_example_on_sim(tmp_path):
    out_json = tmp_path / "summary.json"
    out = run_python("examples/train_gpt.py", "--device", "sim", "--preset", "tiny", "--steps", "15", "--batch", "4",
                     "--seq", "32", "--lr", "3e-3", "--json-out", str(out_json), "--no-progress")
    assert out.returncode == 0, out.stderr
    assert "tokens/s" in out.stdout and "chunk traffic" in out.stdout and "peak memory" in out.stdout
    summary = json.loads(out_json.read_text())
    assert summary["device"] == "sim" and summary["chunks"] >= 2
    assert summary["last_loss"] < summary["first_loss"], "the example model learns"
    assert summary["precision"] == "bf16" and summary["skipped_steps"] == 0
    assert summary["placement"]["optim_chunks_on_host"] == summary["chunks"] > 0, "CPU Adam steps every chunk"
    assert summary["last_optimizer_step"]["host_params"] > 0
    # gradients go down and updated parameters come up every step
    assert summary["chunk_traffic"]["d2h_bytes"] > 0 and summary["chunk_traffic"]["h2d_bytes"] > 0
    setup = summary["setup_seconds"]
    assert set(setup) == {"total", "plan", "allocate", "fill", "place"} and "enable()" in out.stdout
    assert sum(v for k, v in setup.items() if k != "total") == pytest.approx(setup["total"], abs=0.05)
    fill = summary["setup_fill_seconds"]
    assert set(fill) == {"materialize", "from_rank0", "write"} and fill["write"] > 0
    assert sum(fill.values()) <= setup["fill"] + 0.05, "the parts are inside the fill phase"
    assert len(summary["step_seconds"]) == 15 and all(s > 0 for s in summary["step_seconds"])
    assert summary["step_s_median"] in summary["step_seconds"][1:], "the median leaves the warm-up step out"
    assert summary["close_seconds"] > 0 and "closed" not in summary, "the full summary replaced the steps' record"


def test_train_gpt_example_with_a_tiny_budget_and_checkpointing(tmp_path):
    out_json = tmp_path / "summary.json"
    out = run_python("examples/train_gpt.py", "--device", "sim", "--preset", "tiny", "--steps", "6", "--batch", "2",
                     "--seq", "16", "--gpu-limit", "270KiB", "--checkpoint", "--json-out", str(out_json),
                     "--no-progress")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out_json.read_text())
    assert summary["counters"]["evictions"] > 0
    assert summary["peak_chunk_device_bytes"] <= 270 * 1024


def test_memory_timeline_example_writes_a_plot(tmp_path):
    png, js = tmp_path / "timeline.png", tmp_path / "timeline.json"
    out = run_python("examples/plot_memory_timeline.py", "--device", "sim", "--preset", "tiny", "--out", str(png),
                     "--json", str(js))
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(js.read_text())
    kinds = {e["kind"] for e in data["timeline"]["events"]}
    assert {"F", "E", "S"} <= kinds and data["events_in_last_iteration"] > 0
    assert all(e["device_bytes"] <= data["device_budget_bytes"] for e in data["timeline"]["events"])


def test_train_gpt_example_under_torchrun(tmp_path):
    """Two ranks, the model built on the meta device: neither rank ever holds the whole model (a
    model built on the CPU under torchrun: test_distributed)."""
    out_json = tmp_path / "summary.json"
    out = run_python("-m", "torch.distributed.run", "--nproc-per-node", "2", "examples/train_gpt.py",
                     "--device", "sim", "--preset", "tiny", "--steps", "15", "--batch", "2", "--seq", "32",
                     "--lr", "3e-3", "--init-device", "meta", "--json-out", str(out_json), "--no-progress")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("gemini_ext summary") == 1, "rank 0 prints the summary"
    assert "on each of 2 ranks" in out.stdout and "chunk all-gathers" in out.stdout
    summary = json.loads(out_json.read_text())
    assert summary["ranks"] == 2
    assert summary["last_loss"] < summary["first_loss"], "the example model learns over two ranks"
    assert summary["chunk_traffic"]["all_gathers"] > 0 and summary["chunk_traffic"]["reduce_scatters"] > 0


def _example(name):
    import importlib.util
    import os
    from conftest import REPO
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(REPO, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_trainer_example_trains_saves_and_reloads(tmp_path):
    pytest.importorskip("transformers")
    # bf16: the saved files hold the fp32 masters, and the config must say so (save_pretrained inside
    # the engine sees bf16 parameters)
    result = _example("hf_trainer").main(["--steps", "16", "--hidden", "64", "--layers", "2", "--seq", "32",
                                          "--device", "sim", "--precision", "bf16", "--out", str(tmp_path / "llama")])
    assert result["losses"][-1] < result["losses"][0], "the loss goes down"
    assert result["reloaded_identical"], "from_pretrained without gemini_ext gives the trained parameters"


def test_lightning_example_trains():
    pytest.importorskip("lightning")
    losses = _example("lightning_gpt").main(["--steps", "20", "--seq", "64", "--device", "sim"])
    assert len(losses) == 40 and sum(losses[-4:]) < sum(losses[:4])
