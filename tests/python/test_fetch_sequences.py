"""The scheduler end to end on the sim device (the same tests run on cuda): one exact fetch and
evict sequence under a budget through the engine's hooks, prefetching within it, and a changed
access trace re-recorded. Residency's own sequences, eviction rules and last resorts are tested
in C++ (tests/cpp/core/test_residency.cpp)."""

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from parity_utils import config
from placement_utils import CHUNK_BYTES, four_layers, train_four_layers


def _iterations(timeline):
    out, cur = [], []
    for e in timeline["events"]:
        if e["kind"] == "S":
            out.append(cur)
            cur = []
        else:
            cur.append(f"{e['kind']}{e['chunk']}")
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_exact_fetch_and_evict_sequence_under_a_budget_of_two_chunks(device):
    """Four one-chunk layers (parameter chunks 0, 4, 8, 12; each set is P, G, m, v), optimizer
    state on the host, chunks capped at two: one parameter chunk in compute plus one gradient
    chunk is all that fits. Each event 'E' is followed by the fetch ('F') or gradient allocation that
    needed the room. Steady state, from {0} on the device after the previous iteration:
      forward   F4 (fits) | E0 F8 (0 is used last) | E4 F12 (4 after 8 in backward)
      backward  E8 (room for layer 3's gradient chunk; 12 is in compute, 8 the only candidate)
                F8 (fits once that gradient went to the host) | E12 (never used again) for the
                next gradient chunk | F4 | E8 | F0 | E4 (room for the last gradient chunk)."""
    model = four_layers()
    cfg = config(device, placement_policy="const", const_gpu_budget=2 * CHUNK_BYTES, max_prefetch=0)
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        train_four_layers(model, engine, opt, 3)
        timeline = engine.memory_timeline()
        engine.internal.runtime.synchronize()  # every copy and compute event complete: all waits collected
        engine.internal.chunks.poll()
        waits = engine.internal.chunks.traffic()
        fetches = engine.internal.runtime.counters()["sync_fetch_waits"]
    iterations = _iterations(timeline)
    assert iterations[0] == ["F0", "F4", "E0", "F8", "E4", "F12",                 # enable()
                             "E8", "F0", "E12", "F4", "E0", "F8", "E4", "F12",    # warm-up forward (LRU)
                             "E8", "F8", "E12", "F4", "E8", "F0", "E4"]           # warm-up backward
    steady = ["F4", "E0", "F8", "E4", "F12", "E8", "F8", "E12", "F4", "E8", "F0", "E4"]
    assert iterations[1] == steady and iterations[2] == steady
    assert max(e["device_bytes"] for e in timeline["events"]) <= 2 * CHUNK_BYTES
    assert timeline["steps"][-1]["sync_fetches"] == 6
    assert waits["copy_waits"] == fetches and waits["copy_wait_seconds"] > 0, \
        "without prefetch, compute waits for every fetch: from needing the chunk to the copy's end"


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_fetches_ahead_within_the_budget(device):
    model = four_layers()
    cfg = config(device, placement_policy="const", const_gpu_budget=4 * CHUNK_BYTES, max_prefetch=2,
                 offload_param_frac=1.0)
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        train_four_layers(model, engine, opt, 4)
        steps = engine.stats()["steps"]
        timeline = engine.memory_timeline()
    assert steps[0]["prefetches"] == 0, "no trace during the warm-up, no prefetch"
    last = steps[-1]
    assert last["prefetches"] > 0 and last["prefetch_hits"] == last["prefetches"] - last["prefetch_wasted"]
    assert last["sync_fetches"] < steps[0]["sync_fetches"], "prefetch replaces synchronous fetches"
    assert all(e["device_bytes"] <= 4 * CHUNK_BYTES for e in timeline["events"])


def test_a_changed_trace_is_re_recorded():
    from test_hooks import TwoBranches
    torch.manual_seed(0)
    model = TwoBranches()
    with gx.enable(model, config("sim", chunk_config_dict={"chunk_size": 256})) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-2)
        for use_b in (True, True, False, False, True):
            model(torch.randn(4, 16), use_b).backward()
            opt.step()
            opt.zero_grad()
        trace = engine.stats()["trace"]
    assert trace["iterations"] == 5
    assert trace["rerecordings"] == 2, "True->False and False->True changed the order; repeats did not"
