"""The allocator modes (GEMINI_EXT_ALLOCATOR): the chunk pools' accounting and memory pressure
on sim, the mode's errors, and (on the GPU, a fresh process per mode) training parity, exact
statistics, record_stream / empty_cache, and the out-of-memory rescue."""

import json
import math
import os
import re

import pytest
import torch

import gemini_ext as gx
from conftest import REPO, run_python
from parity_utils import LR, WD, batch, config, make_models, max_relative_difference, train_reference

CUDA_BUILD = bool(gx._C.build_info()["cuda"])


def _worker(scenario, mode, **env):
    path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))  # the package from the tree
    out = run_python("tests/python/workers/allocator_worker.py", scenario,
                     env={"GEMINI_EXT_ALLOCATOR": mode, "PYTHONPATH": path, **env})
    return out


# --- CPU: errors, the default mode's statistics, the pools and memory pressure on sim ---------

@pytest.mark.skipif(CUDA_BUILD, reason="a CUDA build: its errors are covered by the cuda tests below")
def test_chunk_mode_on_a_cpu_only_build_fails_at_import_with_the_fix():
    out = run_python("-c", "import gemini_ext", env={"GEMINI_EXT_ALLOCATOR": "chunk"})
    assert out.returncode != 0
    assert "RuntimeError: GEMINI_EXT_ALLOCATOR=chunk: this build of gemini_ext is CPU-only" in out.stderr
    assert "Unset GEMINI_EXT_ALLOCATOR" in out.stderr


def test_an_unknown_mode_is_refused_at_import():
    out = run_python("-c", "import gemini_ext", env={"GEMINI_EXT_ALLOCATOR": "caching"})
    assert out.returncode != 0
    assert "GEMINI_EXT_ALLOCATOR: expected one of ('default', 'chunk'), got 'caching'" in out.stderr


def test_default_mode_reports_itself():
    stats = gx.memory_stats()
    assert stats["mode"] == "default"
    assert set(stats) >= {"allocated_bytes", "reserved_bytes", "chunk_slot_bytes"}
    assert gx.info()["allocator mode"].startswith("default")


def _train(model, engine, steps, first=0, optimizer=torch.optim.AdamW):
    opt = engine.optimizer(optimizer, lr=LR, weight_decay=WD)
    for step in range(first, first + steps):
        x, y = batch(model.cfg, step, engine.compute_device)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_pools_reuse_slots_on_sim_with_exact_accounting():
    model, _ = make_models()
    with gx.enable(model, config("sim", sim_capacity=8 * 4096 * 4)) as engine:  # evicts every step
        _train(model, engine, 4, optimizer=gx.optim.Lion)  # Lion speculates with spares (AdamW in place)
        stats = engine.stats()
        pools, tiers = stats["pools"], stats["tier_bytes"]
        # slots in use: the chunks' copies, and on the host tier the speculative steps' spares
        spares = engine.attached_optimizer.speculation_stats()["spare_bytes"]
        assert spares > 0
        for tier in ("device", "pinned_host", "pageable_host"):
            extra = spares if tier == "pageable_host" else 0
            assert pools[tier]["in_use_bytes"]["current"] == tiers[tier]["current"] + extra, tier
            assert pools[tier]["reserved_bytes"]["current"] >= pools[tier]["in_use_bytes"]["current"], tier
        device = pools["device"]
        fetches = stats["counters"]["fetches"] + stats["traffic"]["prefetches"]
        assert stats["counters"]["evictions"] > 0
        assert device["slots_taken_from_arena"] < fetches, "evicted chunks' slots are reused, not re-allocated"
        assert device["arena_extents"] >= 1
        assert device["reserved_bytes"]["current"] <= 8 * 4096 * 4 + 4096 * 4, "the arena stays within the capacity"
        freed = engine.internal.chunks.trim("device")  # slots not in use and wholly free extents go back
        assert engine.stats()["pools"]["device"]["reserved_bytes"]["current"] == \
            device["reserved_bytes"]["current"] - freed


def test_each_group_takes_one_reserved_arena_extent_and_returns_it_when_it_leaves_the_host():
    model, _ = make_models()
    with gx.enable(model, config("sim", offload_optim_frac=1.0)) as engine:
        assert engine.stats()["pools"]["pageable_host"]["arena_extents"] == 2  # the state comes with the optimizer
        engine.optimizer(torch.optim.AdamW)
        host = engine.stats()["pools"]["pageable_host"]
        # param, grad, exp_avg, exp_avg_sq (fp32: no separate master), one reservation each
        assert host["arena_extents"] == 4
        n_chunks = engine.stats()["num_chunks"]
        assert host["slots_taken_from_arena"] >= n_chunks
    model, _ = make_models()
    with gx.enable(model, config("sim", offload_optim_frac=0.0)) as engine:  # optimizer state on the device
        engine.optimizer(torch.optim.AdamW)
        host = engine.stats()["pools"]["pageable_host"]
        assert host["arena_extents"] < 4, "the groups that moved to the device gave their extents back"
        assert host["reserved_bytes"]["current"] >= host["in_use_bytes"]["current"]


def test_memory_pressure_evicts_idle_chunks_on_sim_and_training_continues_exactly():
    """What the process-wide allocator does when an allocation would fail, driven by hand on sim:
    the managers of the device evict chunks no tensor computes on and give their slots back."""
    model, reference = make_models()
    ref_losses = train_reference(reference, 4, torch.device("cpu"))
    with gx.enable(model, config("sim")) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        losses = []
        for step in range(4):
            x, y = batch(model.cfg, step, engine.compute_device)
            loss = model(x, y)
            if step == 2:  # mid-iteration, after forward: chunks are held, none computes
                # slots the pools cached (a placement's moves free them as their copies end) would serve the
                # request without an eviction: give them back first, so that only evictions can
                engine.internal.chunks.trim("device")
                before = engine.stats()["tier_bytes"]["device"]["current"]
                released = gx._C.reclaim_device_bytes(-1, before)
                after = engine.stats()["tier_bytes"]["device"]["current"]
                assert after < before and released > 0, (before, after, released)
                assert engine.stats()["counters"]["reclaims"] == 1
                assert engine.stats()["counters"]["reclaimed_bytes"] == before - after
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


def test_memory_pressure_reaches_only_the_managers_of_that_device():
    model, _ = make_models()
    with gx.enable(model, config("sim")) as engine:
        _train(model, engine, 1)
        before = engine.stats()["tier_bytes"]["device"]["current"]
        assert gx._C.reclaim_device_bytes(0, 1 << 30) == 0, "cuda:0 has no manager here"
        assert engine.stats()["tier_bytes"]["device"]["current"] == before
    assert gx._C.reclaim_device_bytes(-1, 1 << 30) == 0, "a closed engine is no longer asked"


# --- GPU: a fresh process per mode ----------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["default", "chunk"])
def test_training_matches_plain_pytorch_under_each_mode(mode):
    out = _worker("parity", mode)
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["memory_stats"]["mode"] == mode
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
    assert r["max_param_diff"] <= 1e-5
    assert r["evictions"] > 0, "the budget makes chunks move"
    assert all(p > 0 for p in r["non_model_peak"]), "torch's allocations are measured in both modes"
    # the engine's memory note reads torch's figure from the active allocator (under chunk,
    # torch.cuda.memory_allocated() raises: a 30B run with GEMINI_EXT_LOG=info failed in enable())
    assert re.search(r"chunks on the device .* allocated by torch$", r["memory_figures"]), r["memory_figures"]
    if mode == "chunk":
        assert r["memory_stats"]["allocations"] > 0 and r["memory_stats"]["ooms_failed"] == 0


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["default", "chunk"])
def test_statistics_record_stream_and_empty_cache(mode):
    out = _worker("stats", mode)
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grew = r["during"]["allocated_bytes"]["current"] - r["before"]["allocated_bytes"]["current"]
    assert grew >= 3 << 20
    assert r["after"]["allocated_bytes"]["current"] == r["before"]["allocated_bytes"]["current"]
    assert r["info"].startswith(mode)
    if mode == "chunk":
        assert grew == 3 << 20, "exact: the requested bytes"
        assert r["after"]["record_streams"] == 1
        assert r["after"]["frees"] == r["after"]["allocations"] - (r["before"]["allocations"] - r["before"]["frees"])
        assert r["after_empty"]["reserved_bytes"]["current"] <= r["after"]["reserved_bytes"]["current"]


@pytest.mark.cuda
def test_chunk_mode_rescues_a_step_that_runs_out_of_memory_under_default():
    chunk = _worker("rescue", "chunk")
    assert chunk.returncode == 0, chunk.stderr[-4000:]
    r = json.loads(chunk.stdout.strip().splitlines()[-1])
    assert r["mode"] == "chunk"
    assert r["memory_stats"]["ooms_rescued"] >= 1 and r["memory_stats"]["ooms_failed"] == 0
    assert r["counters"]["reclaims"] >= 1 and r["counters"]["reclaimed_bytes"] > 0
    assert len(r["losses"]) == 2 and all(math.isfinite(v) for v in r["losses"]), r["losses"]
    default = _worker("rescue", "default")
    assert default.returncode != 0, "the same step runs out of memory without the chunk allocator"
    assert "OutOfMemoryError" in default.stderr
    assert "set GEMINI_EXT_ALLOCATOR=chunk" in default.stderr, default.stderr[-3000:]


@pytest.mark.cuda
def test_chunk_mode_after_cuda_was_initialised_says_to_import_gemini_ext_first():
    code = "import torch; torch.zeros(1, device='cuda'); import gemini_ext"
    out = run_python("-c", code, env={"GEMINI_EXT_ALLOCATOR": "chunk"})
    assert out.returncode != 0
    assert "RuntimeError: GEMINI_EXT_ALLOCATOR=chunk: CUDA was already initialised" in out.stderr
    assert "Import gemini_ext before anything touches CUDA" in out.stderr


@pytest.mark.cuda
@pytest.mark.parametrize("env, says", [({"GEMINI_EXT_DEVICE": "sim"}, "GEMINI_EXT_DEVICE=sim"),
                                       ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                                        "PYTORCH_CUDA_ALLOC_CONF")])
def test_chunk_mode_refuses_incompatible_settings(env, says):
    out = run_python("-c", "import gemini_ext", env={"GEMINI_EXT_ALLOCATOR": "chunk", **env})
    assert out.returncode != 0 and says in out.stderr and "RuntimeError" in out.stderr
