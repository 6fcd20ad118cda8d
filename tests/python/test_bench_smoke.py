"""Benchmark scripts keep running: their --smoke modes on the sim device."""

import importlib.util
import json
import math
import os
import re

import pytest
import torch

from conftest import REPO, run_python


def test_chunk_moves_bench_smoke(tmp_path):
    out_json = tmp_path / "moves.json"
    out = run_python("bench/chunk_moves.py", "--smoke", "--json-out", str(out_json))
    assert out.returncode == 0, out.stderr
    assert "per-tensor" in out.stdout and "chunks" in out.stdout
    rows = json.loads(out_json.read_text())["rows"]
    assert {(r["method"], r["direction"]) for r in rows} == {
        (m, d) for m in ("chunks", "per-tensor", "flat") for d in ("H2D", "D2H")}
    assert all(r["ms"] > 0 and r["payload_GB_per_s"] > 0 for r in rows)
    chunk_rows = [r for r in rows if r["method"] == "chunks"]
    assert all(r["bytes_moved"] >= rows[-1]["bytes_moved"] for r in chunk_rows), "chunks move at least the payload"


def test_cpu_optim_bench_smoke():
    """In this process: the kernels are the same ones the suite loads."""
    import importlib.util
    import os
    import sys
    sys.path.insert(0, os.path.join(REPO, "bench"))
    spec = importlib.util.spec_from_file_location("bench_cpu_optim", os.path.join(REPO, "bench", "cpu_optim.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--smoke"])
    assert [r["optimizer"] for r in rows] == ["sgd", "sgd", "lion", "lion", "adagrad", "adagrad"]
    assert all(r["ms"] > 0 for r in rows) and all(rows[k]["speedup"] > 0 for k in (1, 3, 5))


def test_cpu_adam_bench_smoke(tmp_path):
    out_json = tmp_path / "adam.json"
    out = run_python("bench/cpu_adam.py", "--smoke", "--json-out", str(out_json))
    assert out.returncode == 0, out.stderr
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["system"] for r in rows] == ["torch fused AdamW, fp32 grad", "torch fused AdamW + casts, bf16 in/out",
                                           "gemini_ext, fp32 grad", "gemini_ext, bf16 grad + bf16 copy",
                                           "gemini_ext out of place, bf16 grad + copy",
                                           "gemini_ext, bf16 grad + copy, bf16 moments",
                                           "gemini_ext out of place, ..., bf16 moments",
                                           "gemini_ext correction, bf16 grad + copy",
                                           "gemini_ext undo, bf16 grad + copy"]
    assert all(r["ms"] > 0 and r["Gparams_per_s"] > 0 and r["GB_per_s"] > 0 for r in rows)
    assert [r["bytes_per_param"] for r in rows] == [28, 28, 28, 28, 28, 20, 20, 28, 28]
    bandwidth = json.loads(out_json.read_text())["bandwidth_GB_per_s"]
    assert set(bandwidth) == {"copy", "add in place"} and min(bandwidth.values()) > 0
    assert rows[0]["vs_torch_fp32"] == 1.0 and rows[1]["vs_torch_mixed"] == 1.0


def test_scheduler_bench_smoke(tmp_path):
    out_json = tmp_path / "scheduler.json"
    out = run_python("bench/scheduler.py", "--smoke", "--json-out", str(out_json), timeout=900)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["name"] for r in rows] == ["static, params on device", "static, params homed on host",
                                         "static, no prefetch, params on host", "const", "auto"]
    assert all("error" not in r for r in rows), rows
    assert all(r["step_ms"] > 0 and r["peak_chunk_MiB"] <= 300 / 1024 for r in rows)
    no_prefetch = rows[2]
    assert no_prefetch["prefetch_hits"] == 0 and no_prefetch["sync_fetches"] > rows[1]["sync_fetches"]
    assert "| configuration |" in out.stdout


def test_scaling_bench_smoke(tmp_path):
    """Both launch paths of the scaling bench under torchrun: gemini_ext (sim) and FSDP2 (CPU, gloo)."""
    out_json = tmp_path / "scaling.json"
    out = run_python("bench/scaling.py", "--smoke", "--json-out", str(out_json), timeout=900)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["gpus"], r["system"]) for r in rows] == [
        (n, s) for n in (1, 2) for s in ("gemini-static", "fsdp2")]
    assert all("error" not in r for r in rows), [(r["gpus"], r["system"], r["error"]) for r in rows if "error" in r]
    assert all(r["ranks"] == r["gpus"] and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["peak_host_rss_bytes_all_ranks"] >= r["peak_host_rss_bytes_max_rank"] > 0 for r in rows)
    # the same model, data and optimizer settings: the losses agree across systems (bf16 chunks on sim)
    for n in (1, 2):
        losses = [r["last_loss"] for r in rows if r["gpus"] == n]
        assert max(losses) - min(losses) < 0.01, losses
    assert "| GPUs | system |" in out.stdout


def test_offload_bench_smoke(tmp_path):
    """The offload harness end to end on tiny models: the peers on the CPU, gemini_ext on sim, the
    rates process, the derived columns and the markdown / JSON / PNG outputs."""
    prefix = tmp_path / "offload"
    out = run_python("bench/offload.py", "--smoke", "--out", str(prefix), timeout=900)
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "offload.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == ["plain", "gemini-static", "gemini-serial", "gemini-auto"]
    for name in ("plain", "gemini-static", "gemini-serial", "gemini-auto"):
        r = rows[name]
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and r["model_tflops"] > 0
        assert 0 <= r["exposed_optimizer_s_median"] < r["step_s_median"], "the exposed optimizer time is part of a step"
    assert rows["gemini-static"]["overlap_optimizer"] and not rows["gemini-serial"]["overlap_optimizer"]
    # optimizer offloaded, parameters on the device: per step, bf16 gradients down and bf16
    # parameters up, whole chunks (their padding included), nothing else
    g = rows["gemini-static"]
    chunk_bytes = 2 * g["parameters"] + g["chunk_wasted_bytes"]
    assert g["per_step"][-1]["h2d_bytes"] == g["per_step"][-1]["d2h_bytes"] == chunk_bytes
    assert g["pcie_bytes_per_param"] == 2 * chunk_bytes / g["parameters"]
    assert data["rates"]["cpu_adam_params_per_s"] > 0
    losses = [rows[n]["last_loss"] for n in ("plain", "gemini-static", "gemini-serial")]
    assert max(losses) - min(losses) < 0.01, losses
    assert (tmp_path / "offload.md").read_text().startswith("gpt-tiny")
    assert (tmp_path / "offload.png").stat().st_size > 0


@pytest.mark.parametrize("gpus", [1, 2])
def test_capacity_bench_smoke(tmp_path, gpus):
    """The capacity search's loop and table on tiny models (peers on the CPU, gemini_ext on sim),
    one process or two ranks under torchrun (sharded; plain PyTorch left out)."""
    out_json = tmp_path / "capacity.json"
    out = run_python("bench/capacity.py", "--smoke", "--gpus", str(gpus), "--json-out", str(out_json), timeout=900)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["system"] for r in rows] == ["gemini-auto", "gemini-offload-all"][:2 if gpus == 1 else 1]
    assert f"on {gpus} GPU(s)" in out.stdout
    for r in rows:
        assert r["largest"].get("ranks", 1) == gpus, r["largest"]
        largest = "small" if gpus == 1 else "tiny"  # two ranks: the launch path, one preset
        assert [a["preset"] for a in r["attempts"]] == ["tiny", "small"][:2 if gpus == 1 else 1], r
        assert "first_failure" not in r and r["largest"]["preset"] == largest and r["largest"]["parameters"] > 5e4
        assert r["largest"]["setup_seconds"]["total"] > 0 and len(r["largest"]["step_seconds"]) == 3
    assert ("| gemini-offload-all | small |" if gpus == 1 else "| gemini-auto | tiny |") in out.stdout
    assert json.loads(out_json.read_text())["args"]["init_device"] == ("cuda" if gpus == 1 else "meta")


@pytest.mark.parametrize("ranks, child, expected", [
    (1, "raise RuntimeError('CUDA out of memory. Tried to allocate 9.00 GiB')",
     "RuntimeError: CUDA out of memory. Tried to allocate 9.00 GiB"),
    # one rank runs without torchrun: its exit status names the signal
    (1, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "Signal 9 (SIGKILL) ended the rank"),
    (2, "import os, signal\nif os.environ['RANK'] == '1': os.kill(os.getpid(), signal.SIGKILL)",
     "Signal 9 (SIGKILL) received by PID"),
    # with a process group, lines carry "[rankN]:"; rank 0 fails after rank 1, in the barrier
    (2, "import os, torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "if os.environ['RANK'] == '1': raise MemoryError('rank 1 ran out')\ndist.barrier()",
     "[rank1] MemoryError: rank 1 ran out"),
])
def test_a_failed_run_is_recorded_with_its_cause_not_torchruns_report(tmp_path, ranks, child, expected):
    """A child that raises is named by its exception; one killed by a signal (the host's
    out-of-memory killer sends SIGKILL) by the signal: torchrun's own report ("error_file: <N/A>",
    "To enable traceback see ...") says neither. Launched as the benchmarks launch a job."""
    import os
    import subprocess
    import sys

    sys.path.insert(0, os.path.join(REPO, "bench"))
    from offload import failure, launch

    script = tmp_path / "child.py"
    script.write_text(child + "\n")
    cmd, env = launch(str(script), [], ranks)
    assert ("torch.distributed.run" in cmd) == (ranks > 1)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    record = failure(proc, None)
    assert record["error"].startswith(f"exit {proc.returncode}, no summary: ") and expected in record["error"], record
    assert "error_file" not in record["error"] and "To enable traceback" not in record["error"]
    assert record["stderr_tail"] == proc.stderr[-3000:]


def test_a_run_that_fails_in_close_keeps_its_steps(tmp_path):
    """examples/train_gpt.py records its steps before close(); when close() fails (out of
    device memory, say) the harness keeps that record and says where it failed."""
    import os
    import subprocess
    import sys

    sys.path.insert(0, os.path.join(REPO, "bench"))
    from offload import failure

    out_json = tmp_path / "summary.json"
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import runpy, sys\n"
        "import gemini_ext.engine as engine\n"
        "def close(self):\n"
        "    raise RuntimeError('injected failure in close()')\n"
        "engine.GeminiEngine.close = close\n"
        f"sys.argv = ['train_gpt.py', '--device', 'sim', '--preset', 'tiny', '--steps', '3', '--batch', '2', "
        f"'--seq', '16', '--no-progress', '--json-out', {str(out_json)!r}]\n"
        f"runpy.run_path({os.path.join(REPO, 'examples', 'train_gpt.py')!r}, run_name='__main__')\n")
    proc = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode != 0
    record = failure(proc, str(out_json))
    assert record["error"].startswith(f"exit {proc.returncode}, after its 3 steps (partial_summary): "), record["error"]
    assert "injected failure in close()" in record["error"]
    partial = record["partial_summary"]
    assert partial["closed"] is False and len(partial["step_seconds"]) == 3 and partial["preset"] == "tiny"
    assert partial["tokens_per_s"] > 0 and partial["setup_seconds"]["total"] > 0


@pytest.mark.parametrize("ranks, mode", [(2, []), (1, ["--plain"])])
def test_the_peer_builds_on_the_meta_device_and_initialises_what_it_keeps(tmp_path, ranks, mode):
    """FSDP2's meta-device flow (fully_shard on meta, to_empty, GPT.init_weights on the shards)
    and plain PyTorch's (to_empty keeping the tied head): a GPT initialised near zero predicts
    almost uniformly, so the first loss is close to ln(vocab); uninitialised memory is not."""
    import math

    out_json = tmp_path / "peer.json"
    out = run_python("-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "bench/fsdp2_train.py",
                     "--preset", "tiny", "--steps", "2", "--batch", "2", "--seq", "16", "--init-device", "meta",
                     *mode, "--json-out", str(out_json), timeout=600)
    summary = json.loads(out_json.read_text())  # written before a possible gloo teardown abort
    assert summary["ranks"] == ranks, out.stderr[-2000:]
    assert abs(summary["first_loss"] - math.log(256)) < 0.1, summary["first_loss"]


def test_a_timed_out_job_leaves_none_of_its_ranks_running(tmp_path):
    """Killing torchrun alone orphans its ranks, which keep the GPUs' memory: the next attempt
    then runs out of it. run_job kills the whole session."""
    import os
    import sys
    import time

    sys.path.insert(0, os.path.join(REPO, "bench"))
    from offload import JobTimedOut, free_port, run_job

    script = tmp_path / "rank.py"
    script.write_text("import os, sys, time\n"
                      f"open(os.path.join({str(tmp_path)!r}, 'pid' + os.environ['RANK']), 'w')"
                      ".write(str(os.getpid()))\n"
                      "print('rank up', file=sys.stderr, flush=True)\ntime.sleep(600)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(script)]
    with pytest.raises(JobTimedOut) as timed_out:
        run_job(cmd, timeout=12)
    assert timed_out.value.record["error"].startswith("timed out after 12 s"), timed_out.value.record
    assert "rank up" in timed_out.value.record["stderr_tail"]
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    deadline = time.monotonic() + 10  # a killed rank is reaped by init, not at once
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), pids


def test_placement_sweep_reads_what_the_example_reports(tmp_path):
    """bench/placement_sweep.py's rows and table from the example's own summaries (run in this
    process: the runner is the one every other smoke test starts processes with)."""
    import importlib.util
    import sys

    sys.path.insert(0, os.path.join(REPO, "bench"))
    import placement_sweep

    spec = importlib.util.spec_from_file_location("train_gpt", os.path.join(REPO, "examples", "train_gpt.py"))
    train_gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_gpt)
    common = ["--device", "sim", "--preset", "tiny", "--steps", "3", "--batch", "2", "--seq", "16", "--no-progress"]
    rows = [placement_sweep.summarize(name, train_gpt.main(common + extra))
            for name, extra in placement_sweep.configurations(["1.0", "0.5"], ["0.0"])]
    assert [r["name"] for r in rows] == ["static optim 1.0 params 0.0", "static optim 0.5 params 0.0", "auto"]
    assert rows[0]["host_params"] > 0 and rows[0]["device_params"] == 0, "all of the state on the host"
    assert rows[1]["host_params"] > 0 and rows[1]["device_params"] > 0
    assert rows[2]["decision"]["decisions"] >= 1
    text = placement_sweep.table(rows + [{"name": "static optim 0.1 params 0.0", "error": "timed out after 300 s"}])
    assert text.count("(best static)") == 1 and "timed out after 300 s" in text and "auto: " in text


def test_state_dtype_bench_compares_the_runs(tmp_path):
    """bench/state_dtype.py's table and plot from three runs of the example (in this process)."""
    import importlib.util
    import sys

    sys.path.insert(0, os.path.join(REPO, "bench"))
    import state_dtype

    spec = importlib.util.spec_from_file_location("train_gpt", os.path.join(REPO, "examples", "train_gpt.py"))
    train_gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_gpt)
    common = ["--device", "sim", "--preset", "tiny", "--steps", "4", "--batch", "2", "--seq", "16", "--no-progress"]
    rows = {name: train_gpt.main(common + flags) for name, (flags, _) in state_dtype.STATES.items()}
    assert len(rows["8byte"]["losses"]) == 4
    assert rows["8byte"]["losses"] != rows["bf16"]["losses"] != rows["fp32"]["losses"]
    assert not rows["8byte"]["master_weights"] and rows["8byte"]["optimizer_state_dtype"] == "bf16"
    text = state_dtype.table(rows)
    for name in ("fp32 state", "bf16 moments", "8-byte state"):
        assert f"| {name} loss |" in text and f"| {name} |" in text
    assert text.count("against fp32 state over 4 steps: largest difference") == 2
    state_dtype.plot(rows, str(tmp_path / "curves.png"))
    assert os.path.getsize(tmp_path / "curves.png") > 1000


def test_trainer_workers_bench_trains_with_loader_workers(tmp_path, capsys):
    """bench/trainer_workers.py on sim: GeminiTrainer with two DataLoader workers trains and the
    row reports their host memory (in this process: the Trainer forks its workers from it)."""
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("trainer_workers", os.path.join(REPO, "bench", "trainer_workers.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.main(["--preset", "tiny", "--device", "sim", "--workers", "2", "--steps", "3", "--seq", "32",
                    "--out", str(tmp_path / "out")])
    assert r["children_seen"] >= 2 and len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
    assert r["group_pss_last"] > 0 and "| tiny |" in capsys.readouterr().out


def test_rl_phases_bench_times_each_phase_of_the_loop(capsys, tmp_path):
    """bench/rl_phases.py on sim: a tiny Llama generates inside engine.generating(), trains, streams
    its weights (every parameter in bf16), offloads (no chunk left on the device) and reloads; the
    last block's generation is profiled, and the model generates alone after close()."""
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("rl_phases", os.path.join(REPO, "bench", "rl_phases.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--model", "tiny-llama", "--device", "sim", "--budget", "2GiB", "--iterations", "2",
                       "--prompt", "16", "--new", "4", "--profile", str(tmp_path)])
    params = 256 * 64 * 2 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64  # tiny-llama's, untied head
    assert [r["iteration"] for r in rows] == [0, 1]
    for r in rows:
        assert r["stream"]["bytes"] == 2 * params and r["generate_kv_cache"]["kv_cache_bytes"] > 0
        assert r["offloaded"]["after"]["engine_device_bytes"] == 0 < r["offloaded"]["before"]["engine_device_bytes"]
        assert math.isfinite(r["loss"]) and r["generate_s"] > 0
        assert r["settle_s"] >= 0 and r["generate_allocator"] == {}  # torch's allocator counts: cuda only
    out = capsys.readouterr().out
    assert "| 1 |" in out and re.search(r"generation alone: \d+ tokens/s; under the engine .* \d+ tokens/s", out)
    assert "aten::mm" in (tmp_path / "decode_profile.txt").read_text()


def test_hf_models_bench_trains_a_transformers_moe_and_reports_auto(tmp_path):
    """bench/hf_models.py --smoke: a tiny transformers Mixtral through bench/hf_train.py with and
    without the step in backward, each in its own torchrun process; the peers are listed as
    skipped with the reason, and the rows name what auto chose."""
    pytest.importorskip("transformers")
    out = run_python("bench/hf_models.py", "--smoke", "--out", str(tmp_path / "hf"), "--timelines", str(tmp_path / "t"))
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "hf.json").read_text())
    trained = {r["name"]: r for r in rows if "step_s_median" in r}
    assert set(trained) == {"gemini", "gemini-sib"}, [(r["name"], r.get("error")) for r in rows]
    for r in trained.values():
        assert r["model"] == "tiny-mixtral" and len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
        assert r["engine"]["placement"]["policy"] == "auto"
    assert all(r.get("skipped") for r in rows if r["name"] not in trained)
    assert "optimizer chunks" in (tmp_path / "hf.md").read_text()
    assert "; bound: " in (tmp_path / "hf.md").read_text(), "the lane that bounded the step"
    assert "no MFU on sim" in (tmp_path / "hf.md").read_text(), "no GPU's peak to measure against on sim"
    for r in trained.values():  # one more step, profiled: its picture and each lane's busy time
        timeline = r["timeline"]
        assert os.path.getsize(timeline["png"]) > 0 and os.path.exists(timeline["trace"])
        assert timeline["busy_seconds"]["passes"] > 0, timeline


def test_hf_map_bench_estimates_and_bounds_each_row(tmp_path):
    """bench/hf_map.py --smoke --state 8-byte: a tiny Llama with the engine's activation plan through
    bench/hf_train.py on sim; the row carries gx.estimate's prediction made before it ran and its
    bound's parts, the GPU-alone row is listed as skipped on sim, and the table gives the error;
    --reestimate makes that estimate again from what the row recorded. Run as a user runs it: the
    `smoke` preset of the one entry point, `python -m bench`, which writes the run's record
    (bench/records.py) where --records says."""
    pytest.importorskip("transformers")
    out = run_python("-m", "bench", "smoke", "--out", str(tmp_path / "map"), "--records", str(tmp_path / "rec"))
    assert out.returncode == 0, out.stderr
    alone, row = json.loads((tmp_path / "map.json").read_text())
    assert alone["name"] == "gpu-alone" and alone["skipped"]
    assert row["name"] == "gemini-act" and "8-byte state" in row["system"] and len(row["losses"]) == 3, row.get("error")
    assert row["estimate"]["step_s"] > 0 and row["engine"]["activations"]["plan"]["decided"], row["estimate"]
    assert row["bound"]["cpu"] is not None and row["bound"]["bound"] is None  # no GPU alone, no bound
    assert "| 64 (2 x 32) |" in (tmp_path / "map.md").read_text() and "%)" in (tmp_path / "map.md").read_text()
    assert "no MFU on sim" in (tmp_path / "map.md").read_text() and " | - | " in (tmp_path / "map.md").read_text()
    assert row["estimate"]["lanes"]["bound"] and row["engine"]["lanes"]["bound"], "the lanes, estimated and measured"
    # the record: the machine, the tree, and each row as the tables and the estimate's test read it
    record = json.loads((tmp_path / "rec" / "smoke.json").read_text())
    assert record["preset"] == "smoke" and record["runs"] == "bench/hf_map.py --smoke --state 8-byte"
    assert record["machine"]["gpu"] is None and record["machine"]["host_cores"] == os.cpu_count()
    assert len(record["tree"]["engine_sha256"]) == 64 and record["peak_tflops"] is None
    skipped, trained = record["rows"]
    assert skipped["outcome"] == "skipped" and skipped["why"] == alone["skipped"]
    assert trained["outcome"] == "trained" and trained["step_s"] == row["step_s_median"] and trained["mfu"] is None
    assert trained["decided"]["activation_plan"] == {c: row["engine"]["activations"]["plan"][c]
                                                     for c in ("keep", "recompute", "offload")}
    assert trained["estimate_record"]["step_s"] == row["step_s_median"], "what test_estimate_records.py reads"
    # --reestimate: the same tree from the same recorded inputs makes the same estimate, in its own column
    again = run_python("bench/hf_map.py", "--reestimate", str(tmp_path / "map.json"), "--state", "8-byte",
                       "--loss-chunk-tokens", "0", "--out", str(tmp_path / "now"))
    assert again.returncode == 0, again.stderr
    _, now = json.loads((tmp_path / "now.json").read_text())
    assert now["estimate_now"]["step_s"] == pytest.approx(row["estimate"]["step_s"], rel=1e-9), now["estimate_now"]
    assert "estimate now s (error)" in (tmp_path / "now.md").read_text()


def test_every_preset_names_a_runner_and_options_it_takes(capsys):
    """`python -m bench`'s presets (bench/presets.py): each runs a runner that exists with options
    that runner's parser lists, and `show` prints the command a preset runs."""
    import contextlib
    import sys
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import presets
    from bench.__main__ import main as bench
    options = {}
    for runner, (script, _) in presets.RUNNERS.items():
        spec = importlib.util.spec_from_file_location(f"bench_{runner}", os.path.join(REPO, "bench", script))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        with contextlib.suppress(SystemExit):
            module.main(["--help"])
        options[runner] = {w.strip(",[]") for w in capsys.readouterr().out.split() if w.startswith(("--", "[--"))}
    for name, preset in presets.PRESETS.items():
        given = {a for a in preset.args if a.startswith("--")}
        assert given <= options[preset.runner], f"{name}: {sorted(given - options[preset.runner])} unknown"
    assert bench(["show", "llama7b-map-16x2048"]) == 0
    assert capsys.readouterr().out.startswith("python3 bench/hf_map.py --models llama-7b")
    assert bench(["no-such-preset"]) == 2
    if not torch.cuda.is_available():  # a GPU's figures where there is none: refused, not an exit 0 with error rows
        assert bench(["llama7b-map-16x2048"]) == 2
        assert "torch sees none here" in capsys.readouterr().err


def test_hf_map_bound_is_the_longest_of_gpu_cpu_and_link():
    """bench/hf_map.py's bound from a row's figures: 42 host sets of 157M elements at 3.64G/s is
    1.82 s of CPU, 88.7 GB up and 82.4 GB down over 6 steps at 51.3 GB/s is 0.29 s of link; the GPU
    alone's 3.69 s bounds it, and without a GPU-alone figure there is no bound."""
    import sys
    spec = importlib.util.spec_from_file_location("hf_map", os.path.join(REPO, "bench", "hf_map.py"))
    hf_map = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.join(REPO, "bench"))
    spec.loader.exec_module(hf_map)
    row = {"steps": 6, "engine": {"chunk_size": 157319168, "traffic": {"h2d_bytes": 88.7e9, "d2h_bytes": 82.4e9},
                                  "placement": {"optim_chunks_on_host": 42, "decision": {
                                      "cpu_optimizer_elements_per_s": 3.64e9, "h2d_bytes_per_s": 51.3e9}}}}
    b = hf_map.bound(row, 3.69)
    assert b["cpu"] == pytest.approx(42 * 157319168 / 3.64e9) and b["pcie"] == pytest.approx(88.7e9 / 6 / 51.3e9)
    assert b["bound"] == 3.69 and hf_map.bound(row, None)["bound"] is None
    assert hf_map.bound(row, 1.0)["bound"] == pytest.approx(b["cpu"])


def test_hf_train_builds_each_model_where_it_fits():
    """bench/hf_train.py's place for building a model: LLaMA-7B's 27 GB of fp32 weights on an
    80 GB GPU; LLaMA-13B's 52 GB on the CPU for a system with fp32 state, on the GPU in bf16 for one
    that keeps bf16 parameters only (whose CPU build outlasted a row's time); beyond that the CPU."""
    import sys
    import torch
    sys.path.insert(0, os.path.join(REPO, "bench"))
    spec = importlib.util.spec_from_file_location("hf_train", os.path.join(REPO, "bench", "hf_train.py"))
    hf_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_train)
    h100 = 85_017_493_504
    assert hf_train.build_place(26_953_662_464, h100, False) == ("cuda", torch.float32)
    assert hf_train.build_place(52_063_467_520, h100, False) == ("cpu", torch.float32)
    assert hf_train.build_place(52_063_467_520, h100, True) == ("cuda", torch.bfloat16)
    assert hf_train.build_place(120_000_000_000, h100, True) == ("cpu", torch.float32)


def test_trl_grpo_bench_times_the_loops_phases_beside_the_floor(tmp_path):
    """bench/trl_grpo.py on sim: TRL's GRPOTrainer under the engine (the mixin) and alone, each in its
    own process; every iteration's generation, scoring and step timed, the engine's row against the
    floor's, DeepSpeed listed as skipped with the reason (no CUDA device, or no DeepSpeed)."""
    pytest.importorskip("trl")
    spec = importlib.util.spec_from_file_location("trl_grpo", os.path.join(REPO, "bench", "trl_grpo.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # in this process; each system in a child of its own
    bench.main(["--model", "tiny-llama", "--device", "sim", "--budget", "2GiB", "--systems", "gemini,plain,deepspeed",
                "--steps", "2", "--prompt", "8", "--completion", "4", "--out", str(tmp_path / "grpo")])
    rows = {r["system"]: r for r in json.loads((tmp_path / "grpo.json").read_text())}
    for name in ("gemini", "plain"):
        phases = rows[name]["phases"]["seconds"]
        assert all(len(phases[p]) == 2 for p in ("generate", "score", "generate_and_score", "step")), phases
        assert all(math.isfinite(x) for x in rows[name]["losses"]) and len(rows[name]["rewards"]) == 2
    assert rows["gemini"]["engine"]["placement"] and re.search(r"not importable|CUDA", rows["deepspeed"]["skipped"])
    assert re.search(r"\| gemini \| [\d.]+ \(\d+\) \| .* \| [\d.]+x \|", (tmp_path / "grpo.md").read_text())
