"""The scheduler and the placement policies on the sim device (the same tests run on cuda)."""

import contextlib
import os
import re
import warnings

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from parity_utils import (SMALL, config, make_models, max_relative_difference, torch_device, train_gemini,
                          train_reference, train_step)

CHUNK_BYTES = 4096 * 4


def _host_budget(monkeypatch, available):
    """The host budget reads `available` bytes (placement/host_memory.py)."""
    from gemini_ext.placement import host_memory
    budget = host_memory.HostBudget(available, "a test's figure")
    monkeypatch.setattr(host_memory, "host_budget", lambda *args, **kwargs: budget)
    monkeypatch.setattr(host_memory, "host_available_bytes", lambda *args, **kwargs: available)


def _host_room(monkeypatch, room):
    """The host reports memory leaving `room` bytes to plan once its reserve is kept, and the
    model's own host tensors are not counted as given back (the plan then equals `room`)."""
    from gemini_ext.placement import placer as _placement, policies as policy
    available = min(a for a in (room + policy.HOST_RESERVE_BYTES, -(-room * 8 // 7))
                    if a - policy.host_reserve_bytes(a) >= room)
    _host_budget(monkeypatch, available)
    monkeypatch.setattr(_placement.Placer, "_releasable_host_bytes", lambda self: 0)


def _four_layers(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])  # one chunk each


def _train_four_layers(model, engine, opt, steps):
    for _ in range(steps):
        x = torch.randn(8, 64, device=engine.compute_device)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


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
def test_exact_fetch_and_evict_sequence_under_a_budget_of_three_chunks(device):
    """Four one-chunk layers (parameter chunks 0, 4, 8, 12; each set is P, G, m, v), optimizer
    state on the host, chunks capped at three. After the warm-up (LRU), eviction follows the
    recorded trace (farthest next use): fetching 12 in forward evicts 0 (needed last), the
    gradient chunk of layer 3 evicts 4 (needed after 8), fetching 4 in backward evicts 12 (never
    needed again), and fetching 0 evicts 8 (tie: no further use, least recently used)."""
    model = _four_layers()
    cfg = config(device, placement_policy="const", const_gpu_budget=3 * CHUNK_BYTES, max_prefetch=0)
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        assert [p["param_chunk"] for p in engine.internal.runtime.set_placements()] == [0, 4, 8, 12]
        _train_four_layers(model, engine, opt, 3)
        timeline = engine.memory_timeline()
        stats = engine.stats()
    iterations = _iterations(timeline)
    steady = ["F8", "E0", "F12", "E4", "F4", "E12", "F0", "E8"]
    assert iterations[1] == steady and iterations[2] == steady
    # enable() places 0, 4, 8 and evicts 0 for 12 (LRU); the warm-up iteration has no trace, so
    # LRU evicts in forward order (each fetch evicts the chunk used longest ago) and in backward
    assert iterations[0] == ["F0", "F4", "F8", "E0", "F12",                       # enable()
                             "E4", "F0", "E8", "F4", "E12", "F8", "E0", "F12",    # forward
                             "E4", "F4", "E12", "F0", "E8"]                       # backward
    assert all(e["device_bytes"] <= 3 * CHUNK_BYTES for e in timeline["events"])
    assert all(s["device_bytes_peak"] <= 3 * CHUNK_BYTES for s in stats["steps"])
    assert stats["steps"][-1]["evictions"] == 4 and stats["steps"][-1]["sync_fetches"] == 4


@pytest.mark.parametrize("device", DEVICES)
def test_exact_fetch_and_evict_sequence_under_a_budget_of_two_chunks(device):
    """The same model under two chunks: one parameter chunk in compute plus one gradient chunk is
    all that fits. Each event 'E' is followed by the fetch ('F') or gradient allocation that
    needed the room. Steady state, from {0} on the device after the previous iteration:
      forward   F4 (fits) | E0 F8 (0 is used last) | E4 F12 (4 after 8 in backward)
      backward  E8 (room for layer 3's gradient chunk; 12 is in compute, 8 the only candidate)
                F8 (fits once that gradient went to the host) | E12 (never used again) for the
                next gradient chunk | F4 | E8 | F0 | E4 (room for the last gradient chunk)."""
    model = _four_layers()
    cfg = config(device, placement_policy="const", const_gpu_budget=2 * CHUNK_BYTES, max_prefetch=0)
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        _train_four_layers(model, engine, opt, 3)
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
    model = _four_layers()
    cfg = config(device, placement_policy="const", const_gpu_budget=4 * CHUNK_BYTES, max_prefetch=2,
                 offload_param_frac=1.0)
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        _train_four_layers(model, engine, opt, 4)
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


@pytest.mark.parametrize("frac", [0.0, 0.5, 1.0])
def test_static_fractions_select_the_documented_chunks(frac):
    model = _four_layers()
    with gx.enable(model, config("sim", offload_param_frac=frac, offload_optim_frac=frac)) as engine:
        placements = engine.internal.runtime.set_placements()
        stats = engine.stats()["placement"]
    n = round(4 * frac)
    assert [p["param_home_on_host"] for p in placements] == [True] * n + [False] * (4 - n), "params: from the front"
    assert [p["optim_on_host"] for p in placements] == [False] * (4 - n) + [True] * n, "optimizer: from the back"
    assert stats["optim_chunks_on_host"] == n and stats["param_chunks_home_host"] == n


@pytest.mark.cuda
def test_static_plans_the_limit_for_chunks_and_activations():
    """Under static, gpu_memory_limit caps chunks and torch's allocations together: after the
    first iteration the chunk budget is the limit minus what torch needed (its peak, or what its
    allocator holds if more) minus the headroom (1/16 of that, at least 256 MiB); the memory held
    outside torch is not counted against a limit below the device."""
    from gemini_ext.placement import policies as policy
    model = _four_layers()
    limit = 2 << 30
    torch.cuda.empty_cache()  # what earlier tests left cached would count as this one's (it is held from the device)
    with gx.enable(model, config("cuda", gpu_memory_limit=limit)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        assert engine.stats()["device_budget_bytes"] == limit, "the first iteration runs with the whole limit"
        for _ in range(2):
            x = torch.randn(16384, 64, device=engine.compute_device)  # 4 MiB activations per layer
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        stats = engine.stats()
    first = stats["steps"][0]["non_model_peak_bytes"]
    assert first >= 4 * (4 << 20), "four layers' activations were measured"
    decision = stats["placement"]["decision"]
    assert decision["decisions"] == 1 and decision["non_model_peak_bytes"] == first
    need = max(first, decision["non_model_reserved_bytes"])
    headroom = max(policy.NON_MODEL_HEADROOM_MIN, int(need * policy.NON_MODEL_HEADROOM))
    assert stats["device_budget_bytes"] == limit - need - headroom
    assert stats["steps"][-1]["device_bytes_peak"] <= stats["device_budget_bytes"]


def test_static_keeps_the_whole_capacity_on_sim():
    model = _four_layers()
    with gx.enable(model, config("sim", sim_capacity=1 << 20)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        _train_four_layers(model, engine, opt, 2)
        stats = engine.stats()
    assert stats["device_budget_bytes"] == 1 << 20 and stats["placement"]["decision"] == {}


def test_const_needs_its_budget():
    with pytest.raises(ValueError, match="const_gpu_budget"):
        gx.enable(_four_layers(), config("sim", placement_policy="const"))


@pytest.mark.parametrize("device", DEVICES)
def test_auto_moves_optimizer_state_to_the_device_when_it_fits(device):
    model, reference = make_models()
    train_reference(reference, 6, torch_device(device))
    _, stats = train_gemini(model, 6, config(device, placement_policy="auto"))
    decision = stats["placement"]["decision"]
    assert decision["params_fit"] and decision["optim_sets_moved_to_device"] == stats["num_param_chunks"]
    assert stats["placement"]["optim_chunks_on_device"] == stats["num_param_chunks"]
    assert decision["move_seconds"] > 0, "moving every set's state to the device takes time"
    assert stats["steps"][-1]["d2h_bytes"] == 0, "after the warm-up nothing goes to the host"
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


def test_auto_keeps_what_does_not_fit_on_the_host():
    model, reference = make_models()
    train_reference(reference, 6, torch.device("cpu"))
    # room for the parameters and a few chunk sets' optimizer state, not all
    _, stats = train_gemini(model, 6, config("sim", placement_policy="auto", sim_capacity=40 * CHUNK_BYTES))
    moved = stats["placement"]["decision"]["optim_sets_moved_to_device"]
    assert 0 < moved < stats["num_param_chunks"]
    assert stats["placement"]["optim_chunks_on_device"] == moved
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


def test_auto_warns_when_the_parameters_do_not_fit_and_still_trains():
    model, reference = make_models()
    train_reference(reference, 4, torch.device("cpu"))
    with pytest.warns(UserWarning, match=r"the parameter chunks \(.*\) and two chunks in flight do not fit.*"
                                         r"Lower the batch size or use activation checkpointing"):
        _, stats = train_gemini(model, 4, config("sim", placement_policy="auto", sim_capacity=6 * CHUNK_BYTES))
    assert stats["placement"]["decision"]["params_fit"] is False
    assert stats["placement"]["decision"]["optim_sets_moved_to_device"] == 0
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


@pytest.mark.parametrize("capacity_chunks", [None, 28])
def test_auto_keeps_on_the_device_what_the_host_cannot_hold(monkeypatch, capacity_chunks):
    """A host too small for every optimizer state: the front chunk sets' state starts on the
    device (allocated there, it never passes through the host), the host never holds more than
    it has, later decisions keep that state on the device even when the device budget is tight
    (28 chunks: a warning, parameters are evicted instead), and training matches torch."""
    from gemini_ext.placement import policies as policy
    model, reference = make_models()
    train_reference(reference, 6, torch.device("cpu"))
    with gx.enable(make_models()[0], config("sim")) as probe:  # the layout, to size the host
        sizes = [probe.internal.chunks.chunk_info(p["param_chunk"])["shard_numel"] * 4 for p in probe.internal.runtime.set_placements()]
    params_host, optim_host = sum(sizes), sum(sizes) * 3  # fp32: gradient, exp_avg, exp_avg_sq
    limit = params_host + optim_host // 2  # room for half the optimizer state
    _host_room(monkeypatch, limit)
    kw = {"sim_capacity": capacity_chunks * CHUNK_BYTES} if capacity_chunks else {}
    cfg = config("sim", placement_policy="auto", **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gx.enable(model, cfg) as engine:
            forced = engine.internal.placer.current.host_bound_sets
            assert 0 < forced < len(sizes)
            placements = engine.internal.runtime.set_placements()
            assert [p["optim_on_host"] for p in placements] == [i >= forced for i in range(len(sizes))]
            # The front sets' parameter chunks are born on the device beside their state (the
            # host never holds a copy of them): only the others are brought there.
            assert engine.internal.placer.current.params_born_on_device
            assert engine.stats()["traffic"]["h2d_bytes"] == sum(sizes[forced:])
            opt = engine.optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
            for p in placements[:forced]:
                for group in ("state0", "state1"):  # exp_avg, exp_avg_sq: allocated on the device directly
                    chunk = engine.internal.chunks.group_chunk_ids(group)[placements.index(p)]
                    assert engine.internal.chunks.chunk_info(chunk)["shard_tiers"] == "device"
            for step in range(6):
                x, y = batch_of(model, step, 16)
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
            host_peak = engine.internal.chunks.tier_bytes(engine.internal.chunks.host_tier)["peak"]
            stats = engine.stats()
    assert host_peak <= limit, (host_peak, limit)
    decision = stats["placement"]["decision"]
    assert decision["optim_sets_kept_on_device_for_host"] == forced
    assert decision["optim_sets_moved_to_device"] >= forced
    tight = [str(w.message) for w in caught if "the host cannot hold" in str(w.message)]
    assert bool(tight) == (capacity_chunks is not None)
    # the remedy is more ranks or host memory: activations have nothing to do with it
    assert all("more host memory" in m and "batch size" not in m for m in tight), tight
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


def _param_chunk_bytes(device):
    """The 16-bit (here fp32) bytes of each parameter chunk of make_models()'s model, in order."""
    with gx.enable(make_models()[0], config(device)) as probe:
        return [probe.internal.chunks.chunk_info(p["param_chunk"])["shard_numel"] * 4 for p in probe.internal.runtime.set_placements()]


@pytest.mark.parametrize("device", DEVICES)
def test_auto_refuses_while_planning_a_model_the_host_and_device_cannot_hold_together(monkeypatch, device):
    """The host holds a quarter of the optimizer state, and the device only the parameters' worth:
    the other three quarters cannot live anywhere. enable() says so with the figures before it
    takes any memory (on cuda it used to fill the device and fail in the first forward), and the
    caller's model keeps its values and devices."""
    from gemini_ext.placement import policies as policy
    sizes = _param_chunk_bytes(device)
    params_host, optim_host = sum(sizes), sum(sizes) * 3  # fp32: gradient, exp_avg, exp_avg_sq
    _host_room(monkeypatch, params_host + optim_host // 4)
    cap = {"gpu_memory_limit": sum(sizes)} if device == "cuda" else {"sim_capacity": sum(sizes)}
    model, _ = make_models()
    before = {n: (p.detach().clone(), p.device) for n, p in model.named_parameters()}
    with pytest.raises(gx.OutOfMemoryError, match="the model does not fit this rank's host and device memory") as err:
        gx.enable(model, config(device, placement_policy="auto", **cap))
    text = str(err.value)
    assert "must live on the device" in text and "device budget of" in text and "more data-parallel ranks" in text
    assert "kept free for activations" in text, text
    assert ("GEMINI_EXT_ALLOCATOR=chunk" in text) is False, "not even the whole device holds that state"
    for n, p in model.named_parameters():
        assert p.device == before[n][1] and torch.equal(p.detach(), before[n][0]), n


def test_auto_keeps_on_the_device_the_gradients_of_state_the_host_could_not_hold(monkeypatch):
    """The host has room for the parameters and 40% of the optimizer state, the device for 60% of
    that state and 30% of the parameters: parameters are evicted all the time. The host-bound
    sets' gradient chunks, and their parameter chunks born on the device, stay there (the host
    has no room for them); the other parameter chunks make the room, and the host never holds
    more than it has (evicting such gradients to the host would exceed its plan and run it out of
    pinned memory in the first backward). Training matches torch."""
    from gemini_ext.placement import policies as policy
    model, reference = make_models()
    train_reference(reference, 6, torch.device("cpu"))
    sizes = _param_chunk_bytes("sim")
    params_host, optim_host = sum(sizes), sum(sizes) * 3  # fp32: gradient, exp_avg, exp_avg_sq
    limit = params_host + int(optim_host * 0.4)
    _host_room(monkeypatch, limit)
    device_state = optim_host - int(optim_host * 0.4)  # with its gradients
    cfg = config("sim", placement_policy="auto", overlap_optimizer=False,
                 sim_capacity=device_state + int(0.3 * params_host))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the decision says the parameters do not fit beside that state
        _, stats = train_gemini(model, 6, cfg)
    assert stats["placement"]["decision"]["optim_sets_kept_on_device_for_host"] > 0
    assert stats["counters"]["evictions"] > 0, "the device was meant to be too small for every parameter"
    host_peak = stats["tier_bytes"]["pageable_host"]["peak"]
    assert host_peak <= limit, (host_peak, limit)
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


def test_the_budget_error_names_the_gradients_kept_on_the_device_for_the_host(monkeypatch):
    """With the planning check switched off, a device that holds the host-bound state and its
    gradients but no parameter chunk: the error's breakdown accounts for every byte, the kept
    gradients among them, and names the fix that applies (more ranks or host memory)."""
    from gemini_ext.placement import policies as policy
    sizes = _param_chunk_bytes("sim")
    params_host, optim_host = sum(sizes), sum(sizes) * 3
    limit = params_host + int(optim_host * 0.4)
    _host_room(monkeypatch, limit)
    monkeypatch.setattr(policy.AutoPolicy, "_check_device_holds_forced_state", lambda *args, **kwargs: None)
    device_state = optim_host - int(optim_host * 0.4)
    cfg = config("sim", placement_policy="auto", overlap_optimizer=False,
                 sim_capacity=device_state + int(0.1 * params_host))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(gx.OutOfMemoryError, match="none evictable now") as err:
            train_gemini(make_models()[0], 6, cfg)
    text = str(err.value)
    held = int(re.search(r"chunks hold (\d+) bytes", text).group(1))
    breakdown = text.split(" The smallest budget")[0]  # the floor's figures follow it
    parts = [int(n) for n in re.findall(r"\((\d+) bytes\)", breakdown)[1:]]  # after the chunk asked for
    kept = re.search(r"parameter chunks \((\d+) bytes\) and gradient chunks \((\d+) bytes\) of optimizer state the "
                     r"host cannot hold", text)
    assert int(kept.group(1)) + int(kept.group(2)) > 0 and sum(parts) == held, text
    assert "use more data-parallel ranks or free host memory" in text and "offload_optim_frac" not in text
    assert "The smallest budget this model trains under is about" in text


@pytest.mark.parametrize("device", DEVICES)
def test_auto_warm_up_keeps_an_eighth_of_the_device_for_activations_on_cuda(device):
    """Under the default allocator chunks never give way to torch's allocations, so the warm-up
    (activations not measured yet) plans chunks into 7/8 of the device; on sim, where activations
    live on the host, into all of it. The decision after the first step replaces it."""
    from gemini_ext.placement.policies import AutoPolicy
    model, _ = make_models()
    with gx.enable(model, config(device, placement_policy="auto")) as engine:
        warm_up = engine.internal.runtime.device_budget
        if device == "cuda" and gx.allocator.mode() == "default":
            total = torch.cuda.mem_get_info(engine.compute_device)[1]
            assert warm_up == int(total * (1 - AutoPolicy.WARMUP_RESERVE))
        else:
            assert warm_up == engine.internal.device.context.capacity_bytes
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        x, y = (t.to(engine.compute_device) for t in batch_of(model, 0, 16))
        model(x, y).backward()
        opt.step()
        decision = engine.stats()["placement"]["decision"]
        assert engine.internal.runtime.device_budget == decision["chunk_budget_bytes"]
        if device == "cuda":  # the measured budget replaces the warm-up's
            assert decision["chunk_budget_bytes"] != warm_up
        else:  # activations live on the host: nothing to keep free
            assert decision["chunk_budget_bytes"] == warm_up


def _measured(**kw):
    from gemini_ext.placement.policies import Measurements
    base = dict(device_kind="cuda", allocator_mode="default", device_capacity_bytes=100 << 30,
                device_total_bytes=100 << 30, set_shard_bytes=(1 << 30,) * 4, trainable=(True,) * 4,
                set_bytes_per_element=14, compute_itemsize=2, sharded=False, world_size=1)
    return Measurements(**{**base, **kw})


def test_the_measured_budget_leaves_torch_what_it_needed_and_the_memory_outside_it():
    """The safety rule of the chunk budget, on measured figures: torch keeps the larger of its
    peak and its allocator's hold, plus 1/16 of that (at least 256 MiB); on the whole device the
    memory held outside torch is kept too, under a gpu_memory_limit it is not (the limit leaves
    the rest of the device); on sim nothing is kept (activations live on the host)."""
    from gemini_ext.placement.policies import measured_chunk_budget
    GiB = 1 << 30
    m = _measured(non_model_peak_bytes=10 * GiB, non_model_reserved_bytes=12 * GiB, device_other_bytes=GiB)
    assert measured_chunk_budget(m, "auto") == (100 * GiB - 12 * GiB - 12 * GiB // 16 - GiB, [])
    limited = _measured(device_capacity_bytes=24 * GiB, non_model_peak_bytes=10 * GiB, device_other_bytes=GiB)
    assert measured_chunk_budget(limited, "static")[0] == 24 * GiB - 10 * GiB - 10 * GiB // 16
    small = _measured(non_model_peak_bytes=GiB)
    assert measured_chunk_budget(small, "auto")[0] == 100 * GiB - GiB - (256 << 20)
    sim = _measured(device_kind="sim", device_capacity_bytes=8 * GiB, device_total_bytes=8 * GiB)
    assert measured_chunk_budget(sim, "auto")[0] == 8 * GiB
    tight, warnings = measured_chunk_budget(_measured(device_capacity_bytes=4 * GiB, non_model_peak_bytes=3 * GiB),
                                            "auto")
    assert tight == 3 * GiB and "less than three chunks" in warnings[0], "never below three of the largest chunks"


def test_auto_plans_the_host_with_the_memory_the_model_gives_back():
    """A model built on the host occupies memory that enable() gives back as its values land in
    chunks: the host plan counts it, but what enable() allocates on the host before releasing
    anything (a host set's gradient and master, its parameter copy) must fit what is available
    before. Without the released memory the front sets' state goes to the device."""
    from gemini_ext.placement.policies import AutoPolicy, host_reserve_bytes
    GiB = 1 << 30
    policy = AutoPolicy(gx.GeminiConfig(placement_policy="auto"))
    state = 4 * (GiB // 2) * 14  # 4 sets of 512M elements: gradient, master, m, v
    room = state + 4 * GiB  # the state and the parameter copies
    available = room + host_reserve_bytes(room + 8 * GiB) - 8 * GiB
    with_release = policy.initial(_measured(host_available_bytes=available, host_releasable_bytes=8 * GiB))
    assert with_release.host_bound_sets == 0, "the model's 8 GiB come back before the moments are allocated"
    without = policy.initial(_measured(host_available_bytes=available))
    assert without.host_bound_sets > 0 and without.params_born_on_device
    # Released memory does not help what enable() needs before it releases anything.
    before = policy.initial(_measured(host_available_bytes=8 * GiB, host_releasable_bytes=state))
    assert before.host_bound_sets > 0


def test_auto_plans_a_15b_model_built_on_the_host_of_one_h200():
    """The figures of one H200 (150.1 GB) with 128 GiB of host, 124 GiB of it available before
    a 15.4B GPT was built there in fp32: the plan splits the model between host and device under
    the default allocator (the warm-up keeping 1/8 of the device), with the device-stepped sets'
    parameter chunks born on the device, and holds on the host no more than it has."""
    from gemini_ext.placement.policies import AutoPolicy
    GiB = 1 << 30
    elements, sets, model_bytes = 209_780_736, 74, int(15_435.6e6 * 4)
    m = _measured(device_capacity_bytes=150_109_880_320, device_total_bytes=150_109_880_320,
                  set_shard_bytes=(elements * 2,) * sets, trainable=(True,) * sets,
                  host_available_bytes=124 * GiB - model_bytes, host_releasable_bytes=model_bytes)
    policy = AutoPolicy(gx.GeminiConfig(placement_policy="auto"))
    placement = policy.initial(m)
    assert 0 < placement.host_bound_sets < sets and placement.params_born_on_device
    host_sets = sets - placement.host_bound_sets
    assert host_sets * elements * (14 + 2) <= 124 * GiB - 4 * GiB, "state and parameter copies of the host's sets"
    device = placement.host_bound_sets * elements * (14 + 2)
    assert device <= placement.device_budget_bytes, "that state and its parameter chunks fit the warm-up's budget"


def test_bf16_optimizer_state_makes_a_20b_model_plan_on_one_h200():
    """A 20.3B GPT built on meta (nothing on the host yet), one H200 and 124 GiB of host: with
    fp32 moments (14 bytes per element besides the parameter) the host and the device cannot
    hold it and enable() refuses it while planning; with bf16 moments (10 bytes) the plan splits
    it, the front sets' state and parameter chunks born on the device."""
    from gemini_ext.placement.policies import AutoPolicy
    GiB = 1 << 30
    sets, elements = 90, 225_937_408
    figures = dict(device_capacity_bytes=150_109_880_320, device_total_bytes=150_109_880_320,
                   set_shard_bytes=(elements * 2,) * sets, trainable=(True,) * sets, host_available_bytes=124 * GiB)
    policy = AutoPolicy(gx.GeminiConfig(placement_policy="auto"))
    assert gx.placement.costs.set_bytes_per_element(torch.bfloat16, 2, torch.bfloat16) == 10
    with pytest.raises(gx.OutOfMemoryError, match="does not fit this rank's host and device memory"):
        policy.initial(_measured(**figures, set_bytes_per_element=14))
    placement = policy.initial(_measured(**figures, set_bytes_per_element=10))
    assert 0 < placement.host_bound_sets < sets and placement.params_born_on_device
    assert placement.host_bound_sets * elements * (10 + 2) <= placement.device_budget_bytes
    assert (sets - placement.host_bound_sets) * elements * (10 + 2) <= 120 * GiB, "the host's sets and copies"


def test_enable_counts_the_host_memory_a_host_built_model_gives_back(monkeypatch):
    """The engine measures what the model's host tensors will give back: with it the host holds
    every optimizer state, without it (the same MemAvailable) it cannot."""
    from gemini_ext.placement import placer as _placement
    sizes = _param_chunk_bytes("sim")
    model, _ = make_models()
    released = sum(p.numel() * p.element_size() for p in model.parameters())
    needed = sum(sizes) * 4  # fp32 parameter copies, gradients, exp_avg, exp_avg_sq
    available = -(-needed * 8 // 7) - released  # a reserve of 1/8 at this size
    _host_budget(monkeypatch, available)
    with gx.enable(model, config("sim", placement_policy="auto")) as engine:
        assert engine.internal.placer.current.host_bound_sets == 0
    monkeypatch.setattr(_placement.Placer, "_releasable_host_bytes", lambda self: 0)
    with gx.enable(make_models()[0], config("sim", placement_policy="auto")) as engine:
        assert engine.internal.placer.current.host_bound_sets > 0


@pytest.mark.cuda
def test_a_model_built_on_the_gpu_whose_state_the_host_cannot_hold_trains(monkeypatch):
    """The model's own tensors occupy the device while enable() fills the chunks: the state and
    parameter chunks that start on the device get memory as the fill reaches them (the released
    tensors' memory serves them), and training matches torch."""
    from parity_utils import LR, WD, train_step
    sizes = _param_chunk_bytes("cuda")
    _host_room(monkeypatch, sum(sizes) + sum(sizes) * 3 // 2)  # half the optimizer state
    model, reference = make_models()
    model.cuda(), reference.cuda()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    with gx.enable(model, config("cuda", placement_policy="auto")) as engine:
        placement = engine.internal.placer.current
        assert placement.host_bound_sets > 0 and placement.params_born_on_device
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        for step in range(4):
            train_step(model, opt, step, engine.compute_device)
            train_step(reference, ref_opt, step, torch.device("cuda"))
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


@pytest.mark.parametrize("how", ["enable_gradient_accumulation", "no_sync"])
def test_auto_plans_room_for_the_gradients_accumulation_keeps_on_the_device(how):
    """Under accumulation every gradient chunk stays on the device until the step, wherever its
    optimizer state lives: auto's decision reserves them before moving optimizer state there,
    whether the config says so or the loop entered engine.no_sync()."""
    sizes = _param_chunk_bytes("sim")
    capacity = sum(sizes) * 5 // 2 + 2 * max(sizes)  # parameters, two in flight, then 1.5x their bytes

    def decision(accumulate: bool) -> dict:
        model, _ = make_models()
        cfg = config("sim", placement_policy="auto", sim_capacity=capacity,
                     enable_gradient_accumulation=accumulate and how == "enable_gradient_accumulation")
        with gx.enable(model, cfg) as engine:
            opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
            for micro in range(2):
                x, y = batch_of(model, micro, 16)
                with engine.no_sync() if accumulate and how == "no_sync" and micro == 0 else contextlib.nullcontext():
                    model(x, y).backward()
            opt.step()
            return engine.stats()["placement"]["decision"]

    plain, accumulating = decision(False), decision(True)
    assert plain["grad_bytes_kept_for_accumulation"] == 0
    assert accumulating["grad_bytes_kept_for_accumulation"] == sum(sizes)
    assert accumulating["optim_sets_moved_to_device"] < plain["optim_sets_moved_to_device"]
    state = accumulating["optim_sets_moved_to_device"] * max(sizes) * 2  # fp32 exp_avg and exp_avg_sq
    assert sum(sizes) * 2 + 2 * max(sizes) + state <= accumulating["chunk_budget_bytes"]


def test_auto_re_places_when_the_trace_changes(monkeypatch):
    from gemini_ext.placement import policies as policy
    model, _ = make_models()
    calls = []
    real = policy.AutoPolicy.after_iteration

    def spy(self, measured, current):
        calls.append(measured.trace_rerecordings)
        return real(self, measured, current)

    monkeypatch.setattr(policy.AutoPolicy, "after_iteration", spy)
    with gx.enable(model, config("sim", placement_policy="auto")) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        for step, seq in enumerate((16, 16, 16, 8, 8)):  # a shorter sequence changes nothing in the
            x, y = batch_of(model, step, seq)             # order of chunks: no re-placement
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        assert calls == [0], "decided once, after the warm-up"
        with torch.no_grad():  # evaluation between steps re-records the trace: a forward only
            model(*batch_of(model, 9, 16))
        x, y = batch_of(model, 10, 16)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        assert calls == [0, 1], "the changed trace was measured again and re-placed"
        assert engine.stats()["placement"]["decision"]["decisions"] == 2


def batch_of(model, step, seq):
    from parity_utils import batch
    return batch(model.cfg, step, "cpu", seq=seq)


@pytest.mark.parametrize("device", DEVICES)
def test_moving_optimizer_state_between_steps_keeps_parity(device):
    """What auto does when it re-places: optimizer state moves host -> device -> host between
    steps; training must not notice."""
    from parity_utils import LR, WD, train_step
    model, reference = make_models()
    dev = torch_device(device)
    reference.to(dev)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    with gx.enable(model, config(device)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        n = engine.stats()["num_param_chunks"]
        step = 0
        for phase in ("host", "half on device", "back on host"):
            if phase == "half on device":
                for i in range(0, n, 2):
                    engine.internal.runtime.set_optim_on_host(i, False)
                assert engine.stats()["placement"]["optim_chunks_on_device"] == len(range(0, n, 2))
            elif phase == "back on host":
                for i in range(n):
                    engine.internal.runtime.set_optim_on_host(i, True)
                assert engine.stats()["placement"]["optim_chunks_on_device"] == 0
            for _ in range(3):
                train_step(model, opt, step, engine.compute_device)
                train_step(reference, ref_opt, step, dev)
                step += 1
        with pytest.raises(ValueError, match="chunk set index"):
            engine.internal.runtime.set_optim_on_host(n + 5, True)
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


def test_the_predicted_exposed_optimizer_time_follows_the_backward_pass():
    """The rate model (gemini_ext/placement/optimizer_split.py) on figures: two sets of 100 elements, a 1 s backward pass, a CPU at 100
    elements/s. The back set's gradients are complete halfway through backward, the front set's
    at its end; each CPU step starts then or when the previous one ended."""
    from gemini_ext.placement.optimizer_split import predicted_exposed_optimizer_seconds as exposed
    assert exposed([100, 100], [True, True], 1.0, 100.0) == pytest.approx(1.5)  # 0.5 -> 1.5 -> 2.5
    assert exposed([100, 100], [False, True], 1.0, 100.0) == pytest.approx(0.5)  # the back set only
    assert exposed([100, 100], [True, False], 1.0, 100.0) == pytest.approx(1.0)  # from the end of backward
    assert exposed([100, 100], [True, True], 1.0, 1000.0) == pytest.approx(0.1)
    assert exposed([100, 100], [False, False], 1.0, 100.0) == 0.0
    # From step(), overlapping a 1 s next forward that reaches the back set halfway: the front
    # set's step (1 s) delays the forward from its start, the back set's ends at 2 s for 0.5 s.
    assert exposed([100, 100], [True, True], 1.0, 100.0, during_backward=False) == pytest.approx(1.5)
    assert exposed([100, 100], [False, True], 1.0, 100.0, during_backward=False) == pytest.approx(0.5)
    assert exposed([100, 100], [True, False], 1.0, 100.0, during_backward=False) == pytest.approx(1.0)
    assert exposed([100, 100], [False, True], 1.0, 1000.0, during_backward=False) == 0.0


@pytest.mark.parametrize("window", ["backward", "next forward"])
def test_auto_weighs_state_beyond_what_fits_with_the_measured_rates(window):
    """A 1.34B GPT's chunk sets (10 of 134.8M elements) under a 24 GiB limit with 15 GiB of
    activations: the state of two sets fits beside the parameters. With the H200's rates (16
    cores stepping 4.4G elements/s, 50 GB/s copies, a 0.12 s backward) a further set would save
    31 ms of CPU and cost more in fetches: nothing more moves. With a host a tenth as fast the
    fetches are worth it: more sets move, displacing parameter chunks, and the prediction falls."""
    from gemini_ext.placement.policies import AutoPolicy, Placement, SetPlacement
    elements, sets = 134_807_552, 10
    policy = AutoPolicy(gx.GeminiConfig(placement_policy="auto"))
    current = Placement(tuple(SetPlacement(optim_on_host=True) for _ in range(sets)))
    figures = dict(device_capacity_bytes=24 << 30, device_total_bytes=150_109_880_320,
                   set_shard_bytes=(elements * 2,) * sets, trainable=(True,) * sets,
                   non_model_peak_bytes=15 << 30, forward_seconds=0.06, backward_seconds=0.12, h2d_bytes_per_s=50e9,
                   optimizer_steps_during_backward=window == "backward")
    fast = policy.after_iteration(_measured(**figures, cpu_optimizer_elements_per_s=4.4e9), current).decision
    assert fast["optimizer_window"] == window
    assert fast["optim_sets_moved_to_device"] == 2 and fast["optim_sets_beyond_fit"] == 0
    assert fast["displaced_param_bytes"] == 0 and fast["predicted_exposed_optimizer_s"] > 0
    slow = policy.after_iteration(_measured(**figures, cpu_optimizer_elements_per_s=4.4e8), current).decision
    assert slow["optim_sets_beyond_fit"] > 0 and slow["displaced_param_bytes"] > 0
    assert slow["optim_sets_moved_to_device"] == 2 + slow["optim_sets_beyond_fit"]
    stay = policy.after_iteration(_measured(**{**figures, "h2d_bytes_per_s": 0}, cpu_optimizer_elements_per_s=4.4e8),
                                  current).decision
    assert "optim_sets_beyond_fit" not in stay and stay["optim_sets_moved_to_device"] == 2, "no rates: what fits"
    assert slow["predicted_exposed_optimizer_s"] + slow["predicted_fetch_s"] < _predicted_at_fit(
        elements, sets, 2, 0.12 if window == "backward" else 0.06, 4.4e8, window == "backward"), \
        "what it chose beats staying at what fits"


def test_the_link_lane_takes_host_sets_where_the_cpu_alone_would_be_waited_for():
    """optimizer_lanes.py on figures: four host sets of 100 elements behind four device sets, a
    1 s next forward (it reaches the host sets at 0.5, 0.625, 0.75 and 0.875 s), the CPU probed at
    100 elements/s and the link lane at 50. The CPU alone ends at 4 s: the forward waits 3.125 s.
    While both step they keep the shares s_cpu, s_link of those rates (0.84 and 0.70: 84 and 35
    elements/s). By list scheduling (each set to the lane that would finish it first; a tie stays on
    the CPU) the sets go CPU, CPU, link, CPU, done at 1.19, 2.38, 2.86 and 3.57 s: the last one
    waits 3.57 - 0.875 s. With the probed rates the link lane would have ended last. A CPU fast
    enough for the window takes none, and without a link rate, or with steps during backward
    (speculation), nothing changes."""
    from gemini_ext.placement.optimizer_lanes import RATE_SHARES_WHILE_BOTH_RUN, link_lane_sets
    s_cpu, s_link = RATE_SHARES_WHILE_BOTH_RUN
    on_host = [False] * 4 + [True] * 4
    figures = dict(set_shard_bytes=(200,) * 8, trainable=(True,) * 8, forward_seconds=1.0,
                   cpu_optimizer_elements_per_s=100.0, link_optimizer_elements_per_s=50.0)
    chosen, decision = link_lane_sets(_measured(**figures), on_host)
    assert chosen == (6,)
    assert decision["predicted_exposed_cpu_only_s"] == pytest.approx(3.125)
    assert decision["predicted_exposed_with_link_s"] == pytest.approx(3 * 100 / (100 * s_cpu) - 0.875)
    # a link lane that keeps all its rate and a CPU that loses half: the link lane takes two sets
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("gemini_ext.placement.optimizer_lanes.RATE_SHARES_WHILE_BOTH_RUN", (0.5, 1.0))
        assert link_lane_sets(_measured(**figures), on_host)[0] == (5, 7)
    chosen, decision = link_lane_sets(_measured(**{**figures, "cpu_optimizer_elements_per_s": 1e4}), on_host)
    assert chosen == () and decision["link_lane_sets"] == 0
    assert link_lane_sets(_measured(**{**figures, "link_optimizer_elements_per_s": 0.0}), on_host) == ((), {})
    assert link_lane_sets(_measured(**figures, optimizer_steps_during_backward=True), on_host) == ((), {})


def test_a_split_is_checked_against_the_step_it_ran():
    """optimizer_lanes.rebalanced_link_sets on the figures above, with a 1.5 s forward of which
    0.5 s waited for the step (a 1 s window). The first split gave the link lane nothing (a long
    first forward), and the step measured the CPU alone at 100 elements/s: at the shares the link
    lane takes set 6, as it would have first. Both lanes measured at 60/s while both ran: sets 5
    and 7 go to the link lane, the wait falls from 5 - 0.875 to 3.33 - 0.75 s. A fast CPU needs no
    lane; a gain under the margin keeps the split; a window the wait filled, or steps during
    backward, leave it unchecked."""
    from gemini_ext.placement import optimizer_lanes as lanes
    on_host = [False] * 4 + [True] * 4
    figures = dict(set_shard_bytes=(200,) * 8, trainable=(True,) * 8, forward_seconds=1.5,
                   forward_optimizer_wait_seconds=0.5, cpu_optimizer_elements_per_s=1e4,
                   link_optimizer_elements_per_s=50.0)
    chosen, checked = lanes.rebalanced_link_sets(_measured(**figures, cpu_lane_elements_per_s_in_step=100.0),
                                                 on_host, ())
    assert chosen == (6,) and checked["forward_without_optimizer_wait_s"] == pytest.approx(1.0)
    assert checked["predicted_wait_kept_split_s"] == pytest.approx(3.125)
    both = dict(cpu_lane_elements_per_s_in_step=60.0, link_lane_elements_per_s_in_step=60.0)
    chosen, checked = lanes.rebalanced_link_sets(_measured(**figures, **both), on_host, (6,))
    assert chosen == (5, 7) and checked["link_lane_sets"] == 2
    assert checked["predicted_wait_kept_split_s"] == pytest.approx(5 - 0.875)
    assert checked["predicted_wait_rebalanced_s"] == pytest.approx(200 / 60 - 0.75)
    assert lanes.rebalanced_link_sets(_measured(**figures, **both), on_host, (5, 7))[0] == (5, 7)
    fast = dict(cpu_lane_elements_per_s_in_step=1e4, link_lane_elements_per_s_in_step=60.0)
    assert lanes.rebalanced_link_sets(_measured(**figures, **fast), on_host, (6,))[0] == ()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lanes, "REBALANCE_MARGIN", 2.0)  # 2 s of the 1 s window: no gain is enough
        assert lanes.rebalanced_link_sets(_measured(**figures, **both), on_host, (6,))[0] == (6,)
    filled = {**figures, "forward_optimizer_wait_seconds": 1.5}
    assert lanes.rebalanced_link_sets(_measured(**filled, **both), on_host, (6,)) == ((6,), {})
    during = _measured(**figures, **both, optimizer_steps_during_backward=True)
    assert lanes.rebalanced_link_sets(during, on_host, (6,)) == ((6,), {})


def test_auto_gives_up_the_link_lane_when_the_step_shows_the_cpu_keeps_up(monkeypatch):
    """End to end on sim with the probes replaced: a CPU probed at 10k elements/s and a link lane
    at 10k make the first decision split the host sets between them; the steps then run at the
    host's real speed, the CPU alone keeps up with the forward, and the check after the next step
    takes the lane away again (stats() and the runtime agree). Clipping keeps the steps at step();
    the copy probe's 0 keeps the state at what fits. Training matches torch throughout."""
    from gemini_ext.placement import optimizer_lanes, rates as _rates
    monkeypatch.setitem(_rates._cache, "cpu", 1e4)
    monkeypatch.setattr(_rates, "link_optimizer_elements_per_s", lambda device: 1e4)
    monkeypatch.setattr(_rates, "h2d_bytes_per_s", lambda device: 0.0)
    model, reference = make_models()
    train_reference(reference, 6, torch.device("cpu"), max_norm=0.05)
    _, stats = train_gemini(model, 6, config("sim", placement_policy="auto", sim_capacity=40 * CHUNK_BYTES,
                                             max_norm=0.05))
    decision = stats["placement"]["decision"]
    assert decision["link_lane_sets"] > 0 and decision["predicted_exposed_cpu_only_s"] > 0, decision
    assert decision["lane_rebalances"] == optimizer_lanes.REBALANCES
    assert decision["rebalance_link_lane_sets"] == 0 and stats["placement"]["optim_chunks_link_lane"] == 0
    assert decision["rebalance_cpu_lane_elements_per_s_in_step"] > 1e4
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


def _predicted_at_fit(elements, sets, on_device, window_seconds, rate, during_backward):
    from gemini_ext.placement.optimizer_split import predicted_exposed_optimizer_seconds
    return predicted_exposed_optimizer_seconds([elements] * sets, [i >= on_device for i in range(sets)],
                                               window_seconds, rate, during_backward)


@pytest.mark.parametrize("cpu_rate,max_norm", [(1e12, 0.0), (1e4, 0.0), (1e4, 0.05)],
                         ids=["fast-host", "slow-host", "slow-host-clipping"])
def test_auto_moves_state_past_the_parameters_when_the_host_is_slow(monkeypatch, cpu_rate, max_norm):
    """End to end on sim with the CPU optimizer's measured rate replaced: a fast host keeps to the
    state that fits beside the parameters; a slow one moves more, its parameter chunks are evicted
    and fetched again each iteration, and training still matches torch. Without clipping the CPU
    steps start during backward (speculation) and the backward is the window; under clipping the
    warm-up arms none (no norm yet) and the window is the next forward."""
    from gemini_ext.placement import rates as _rates
    monkeypatch.setitem(_rates._cache, "cpu", cpu_rate)
    model, reference = make_models()
    train_reference(reference, 6, torch.device("cpu"), max_norm=max_norm)
    _, stats = train_gemini(model, 6, config("sim", placement_policy="auto", sim_capacity=40 * CHUNK_BYTES,
                                             max_norm=max_norm))
    decision = stats["placement"]["decision"]
    assert decision["forward_seconds"] > 0 and decision["backward_seconds"] > 0 and decision["h2d_bytes_per_s"] > 0
    assert decision["optimizer_window"] == ("next forward" if max_norm else "backward")
    assert decision["cpu_optimizer_elements_per_s"] == cpu_rate
    if cpu_rate > 1e6:
        assert decision["optim_sets_beyond_fit"] == 0 and stats["steps"][-1]["evictions"] == 0
    else:
        assert decision["optim_sets_beyond_fit"] > 0 and decision["displaced_param_bytes"] > 0
        assert stats["steps"][-1]["evictions"] > 0, "the displaced parameter chunks are fetched again"
    assert stats["placement"]["optim_chunks_on_device"] == decision["optim_sets_moved_to_device"]
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


def test_auto_decides_without_rates_when_a_probe_cannot_run(monkeypatch):
    """A rate probe that finds no memory for its buffer leaves the decision to what fits."""
    from gemini_ext.placement import rates as _rates

    def no_memory(device):
        raise torch.OutOfMemoryError("no memory for the probe")

    monkeypatch.setattr(_rates, "h2d_bytes_per_s", no_memory)
    model, reference = make_models()
    train_reference(reference, 4, torch.device("cpu"))
    _, stats = train_gemini(model, 4, config("sim", placement_policy="auto", sim_capacity=40 * CHUNK_BYTES))
    decision = stats["placement"]["decision"]
    assert "optim_sets_beyond_fit" not in decision, "no rates, no weighing"
    assert 0 < decision["optim_sets_moved_to_device"] < stats["num_param_chunks"]
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


def _cgroup_tree(root, proc_lines, files):
    root.mkdir(parents=True)
    proc = root / "proc_cgroup"
    proc.write_text("".join(line + "\n" for line in proc_lines))
    for rel, text in files.items():
        (root / "fs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "fs" / rel).write_text(text + "\n")
    return str(proc), str(root / "fs")


def test_the_host_budget_reads_the_cgroup_limits_as_the_kernel_enforces_them(tmp_path, monkeypatch):
    from gemini_ext.placement import host_memory
    GiB = 1 << 30
    # cgroup v2: the tightest of the cgroup and its ancestors, limit less usage ("max": none)
    proc, root = _cgroup_tree(tmp_path / "v2", ["0::/kubepods/pod1/c1"], {
        "kubepods/memory.max": str(64 * GiB), "kubepods/memory.current": str(60 * GiB),
        "kubepods/pod1/memory.max": str(16 * GiB), "kubepods/pod1/memory.current": str(2 * GiB),
        "kubepods/pod1/c1/memory.max": "max", "kubepods/pod1/c1/memory.current": str(1 * GiB)})
    room, source = host_memory.cgroup_room(proc, root)
    assert room == 4 * GiB and source.endswith("kubepods/memory.max"), (room, source)
    # cgroup v1: the memory controller's hierarchy; its "no limit" is a number near 2**63
    proc, root = _cgroup_tree(tmp_path / "v1", ["5:cpu,cpuacct:/job", "4:memory:/slurm/job7"], {
        "memory/slurm/memory.limit_in_bytes": str(2 ** 63 - 4096), "memory/slurm/memory.usage_in_bytes": "0",
        "memory/slurm/job7/memory.limit_in_bytes": str(8 * GiB),
        "memory/slurm/job7/memory.usage_in_bytes": str(3 * GiB)})
    assert host_memory.cgroup_room(proc, root) == (5 * GiB, os.path.join(root, "memory/slurm/job7/memory.limit_in_bytes"))
    assert host_memory.cgroup_room(str(tmp_path / "absent"), root) is None
    # the budget: the least of MemAvailable and the cgroup's room, shared by the ranks on the host
    monkeypatch.setattr(host_memory, "mem_available_bytes", lambda: 100 * GiB)
    budget = host_memory.host_budget(2, proc, root)
    assert budget.bytes == 5 * GiB // 2 and "memory/slurm/job7/memory.limit_in_bytes" in budget.source, budget
    assert "shared by the 2 ranks" in budget.source
    monkeypatch.setattr(host_memory, "mem_available_bytes", lambda: 4 * GiB)
    assert host_memory.host_budget(1, proc, root).source.startswith("MemAvailable")


def test_enable_refuses_a_plan_over_the_cgroup_limit_naming_it(monkeypatch):
    """The auto policy plans the host with the cgroup's room, not the machine's MemAvailable,
    and refuses before taking any memory, naming the limit's file."""
    from gemini_ext.placement import host_memory, placer as _placement
    sizes = _param_chunk_bytes("sim")
    room = sum(sizes) + sum(sizes) * 3 // 4  # a quarter of the optimizer state has no home
    monkeypatch.setattr(host_memory, "cgroup_room", lambda *a, **k: (room + 64 * 1024, "/sys/fs/cgroup/job/memory.max"))
    monkeypatch.setattr(_placement.Placer, "_releasable_host_bytes", lambda self: 0)
    model, _ = make_models()
    with pytest.raises(gx.OutOfMemoryError, match="the cgroup limit /sys/fs/cgroup/job/memory.max"):
        gx.enable(model, config("sim", placement_policy="auto", sim_capacity=sum(sizes)))


def test_the_cpu_probe_outgrows_the_last_level_cache(tmp_path):
    """The CPU optimizer's probe steps arrays several times the largest cache (sysfs), within
    its bounds: a probe held in cache measured twice the kernel's rate over real state."""
    from gemini_ext.placement import rates as _rates
    for index, size in (("index0", "32K"), ("index2", "2048K"), ("index3", "105M")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    cache = _rates.last_level_cache_bytes(str(tmp_path))
    assert cache == 105 << 20
    elements = _rates.cpu_probe_elements(cache)
    assert elements * _rates.CPU_PROBE_BYTES_PER_ELEMENT == _rates.CPU_PROBE_CACHE_MULTIPLE * cache
    assert _rates.last_level_cache_bytes(str(tmp_path / "absent")) == 0
    assert _rates.cpu_probe_elements(0) == _rates.PROBE_ELEMENTS
    assert _rates.cpu_probe_elements(1 << 40) == _rates.CPU_PROBE_MAX_ELEMENTS


def test_auto_probes_the_rates_when_enable_plans_before_any_step(monkeypatch):
    """The probes run inside enable(), before the host's optimizer pipeline has anything to run
    beside them, and the first decision reads the rate they measured then."""
    from gemini_ext.placement import rates as _rates
    monkeypatch.setattr(_rates, "_cache", {})
    model, _ = make_models()
    with gx.enable(model, config("sim", placement_policy="auto", sim_capacity=40 * CHUNK_BYTES)) as engine:
        probed = dict(_rates._cache)
        assert probed.get("cpu", 0) > 0, "probed during enable()"
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        for step in range(2):
            train_step(model, opt, step, engine.compute_device)
        decision = engine.stats()["placement"]["decision"]
    assert decision["cpu_optimizer_elements_per_s"] == probed["cpu"]
