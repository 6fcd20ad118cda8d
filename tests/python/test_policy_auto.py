"""The `auto` placement policy: optimizer state moved to the device where it fits, the host plan
(what the host cannot hold stays on the device, the memory a host-built model gives back), the
warm-up's reserve, the measured chunk budget, accumulation, re-placement when the trace changes,
and parity with torch while state moves between steps."""

import contextlib
import re
import warnings

import pytest
import torch

import gemini_ext as gx
from gemini_ext.placement import policies as policy
from conftest import DEVICES
from parity_utils import (config, make_models, max_relative_difference, torch_device, train_gemini,
                          train_reference)
from placement_utils import CHUNK_BYTES, host_budget, host_with_free_bytes, measured, param_chunk_bytes


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
    """Parameter chunks beyond the whole device: the warning says a smaller batch would not help and
    names what would, at the line of the user's code that stepped (here parity_utils' loop), not
    inside gemini_ext or torch."""
    model, reference = make_models()
    train_reference(reference, 4, torch.device("cpu"))
    with pytest.warns(UserWarning, match=r"the parameter chunks \(.*\) and two chunks in flight do not fit.*"
                                         r"even without activations.*raise gpu_memory_limit") as caught:
        _, stats = train_gemini(model, 4, config("sim", placement_policy="auto", sim_capacity=6 * CHUNK_BYTES))
    placed = [w for w in caught if "two chunks in flight" in str(w.message)]
    assert placed and all(w.filename.endswith("parity_utils.py") for w in placed), [w.filename for w in placed]
    assert stats["placement"]["decision"]["params_fit"] is False
    assert stats["placement"]["decision"]["optim_sets_moved_to_device"] == 0
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


@pytest.mark.parametrize("capacity_chunks", [None, 28])
def test_auto_keeps_on_the_device_what_the_host_cannot_hold(monkeypatch, capacity_chunks):
    """A host too small for every optimizer state: the front chunk sets' state starts on the
    device (allocated there, it never passes through the host), the host never holds more than
    it has, later decisions keep that state on the device even when the device budget is tight
    (28 chunks: a warning, parameters are evicted instead), and training matches torch."""
    model, reference = make_models()
    train_reference(reference, 6, torch.device("cpu"))
    with gx.enable(make_models()[0], config("sim")) as probe:  # the layout, to size the host
        sizes = [probe.internal.chunks.chunk_info(p["param_chunk"])["shard_numel"] * 4
                 for p in probe.internal.runtime.set_placements()]
    params_host, optim_host = sum(sizes), sum(sizes) * 3  # fp32: gradient, exp_avg, exp_avg_sq
    limit = params_host + optim_host // 2  # room for half the optimizer state
    host_with_free_bytes(monkeypatch, limit)
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




@pytest.mark.parametrize("device", DEVICES)
def test_auto_refuses_while_planning_a_model_the_host_and_device_cannot_hold_together(monkeypatch, device):
    """The host holds a quarter of the optimizer state, and the device only the parameters' worth:
    the other three quarters cannot live anywhere. enable() says so with the figures before it
    takes any memory (on cuda it used to fill the device and fail in the first forward), and the
    caller's model keeps its values and devices."""
    sizes = param_chunk_bytes(device)
    params_host, optim_host = sum(sizes), sum(sizes) * 3  # fp32: gradient, exp_avg, exp_avg_sq
    host_with_free_bytes(monkeypatch, params_host + optim_host // 4)
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
    model, reference = make_models()
    train_reference(reference, 6, torch.device("cpu"))
    sizes = param_chunk_bytes("sim")
    params_host, optim_host = sum(sizes), sum(sizes) * 3  # fp32: gradient, exp_avg, exp_avg_sq
    limit = params_host + int(optim_host * 0.4)
    host_with_free_bytes(monkeypatch, limit)
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
    sizes = param_chunk_bytes("sim")
    params_host, optim_host = sum(sizes), sum(sizes) * 3
    limit = params_host + int(optim_host * 0.4)
    host_with_free_bytes(monkeypatch, limit)
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


def test_the_measured_budget_leaves_torch_what_it_needed_and_the_memory_outside_it():
    """The safety rule of the chunk budget, on measured figures: torch keeps the larger of its
    peak and its allocator's hold, plus 1/16 of that (at least 256 MiB); on the whole device the
    memory held outside torch is kept too, under a gpu_memory_limit as well (a limit is what a card
    of that size holds, the CUDA context included); on sim nothing is kept (activations live on the host)."""
    from gemini_ext.placement.policies import measured_chunk_budget
    GiB = 1 << 30
    m = measured(non_model_peak_bytes=10 * GiB, non_model_reserved_bytes=12 * GiB, device_other_bytes=GiB)
    assert measured_chunk_budget(m, "auto") == (100 * GiB - 12 * GiB - 12 * GiB // 16 - GiB, [])
    limited = measured(device_capacity_bytes=24 * GiB, non_model_peak_bytes=10 * GiB, device_other_bytes=GiB)
    assert measured_chunk_budget(limited, "static")[0] == 24 * GiB - 10 * GiB - 10 * GiB // 16 - GiB
    small = measured(non_model_peak_bytes=GiB)
    assert measured_chunk_budget(small, "auto")[0] == 100 * GiB - GiB - (256 << 20)
    sim = measured(device_kind="sim", device_capacity_bytes=8 * GiB, device_total_bytes=8 * GiB)
    assert measured_chunk_budget(sim, "auto")[0] == 8 * GiB
    tight, warnings = measured_chunk_budget(measured(device_capacity_bytes=4 * GiB, non_model_peak_bytes=3 * GiB),
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
    with_release = policy.initial(measured(host_available_bytes=available, host_releasable_bytes=8 * GiB))
    assert with_release.host_bound_sets == 0, "the model's 8 GiB come back before the moments are allocated"
    without = policy.initial(measured(host_available_bytes=available))
    assert without.host_bound_sets > 0 and without.params_born_on_device
    # Released memory does not help what enable() needs before it releases anything.
    before = policy.initial(measured(host_available_bytes=8 * GiB, host_releasable_bytes=state))
    assert before.host_bound_sets > 0


def test_auto_plans_a_15b_model_built_on_the_host_of_one_h200():
    """The figures of one H200 (150.1 GB) with 128 GiB of host, 124 GiB of it available before
    a 15.4B GPT was built there in fp32: the plan splits the model between host and device under
    the default allocator (the warm-up keeping 1/8 of the device), with the device-stepped sets'
    parameter chunks born on the device, and holds on the host no more than it has."""
    from gemini_ext.placement.policies import AutoPolicy
    GiB = 1 << 30
    elements, sets, model_bytes = 209_780_736, 74, int(15_435.6e6 * 4)
    m = measured(device_capacity_bytes=150_109_880_320, device_total_bytes=150_109_880_320,
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
        policy.initial(measured(**figures, set_bytes_per_element=14))
    placement = policy.initial(measured(**figures, set_bytes_per_element=10))
    assert 0 < placement.host_bound_sets < sets and placement.params_born_on_device
    assert placement.host_bound_sets * elements * (10 + 2) <= placement.device_budget_bytes
    assert (sets - placement.host_bound_sets) * elements * (10 + 2) <= 120 * GiB, "the host's sets and copies"


def test_enable_counts_the_host_memory_a_host_built_model_gives_back(monkeypatch):
    """The engine measures what the model's host tensors will give back: with it the host holds
    every optimizer state, without it (the same MemAvailable) it cannot."""
    from gemini_ext.placement import placer as _placement
    sizes = param_chunk_bytes("sim")
    model, _ = make_models()
    released = sum(p.numel() * p.element_size() for p in model.parameters())
    needed = sum(sizes) * 4  # fp32 parameter copies, gradients, exp_avg, exp_avg_sq
    available = -(-needed * 8 // 7) - released  # a reserve of 1/8 at this size
    host_budget(monkeypatch, available)
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
    sizes = param_chunk_bytes("cuda")
    host_with_free_bytes(monkeypatch, sum(sizes) + sum(sizes) * 3 // 2)  # half the optimizer state
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
    sizes = param_chunk_bytes("sim")
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
