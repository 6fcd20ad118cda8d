"""`auto`'s rate model: the predicted exposed CPU optimizer time, state moved beyond what fits
with the measured rates, the link lane's split and its check against the step, deciding without
rates, and the probes themselves."""

import pytest
import torch

import gemini_ext as gx
from parity_utils import config, make_models, max_relative_difference, train_gemini, train_reference, train_step
from placement_utils import CHUNK_BYTES, measured


def test_the_predicted_exposed_optimizer_time_follows_the_backward_pass():
    """The rate model (gemini_ext/placement/optimizer_split.py) on figures: two sets of 100
    elements, a 1 s backward pass, a CPU at 100 elements/s. The back set's gradients are complete
    halfway through backward, the front set's at its end; each CPU step starts then or when the
    previous one ended."""
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
    fast = policy.after_iteration(measured(**figures, cpu_optimizer_elements_per_s=4.4e9), current).decision
    assert fast["optimizer_window"] == window
    assert fast["optim_sets_moved_to_device"] == 2 and fast["optim_sets_beyond_fit"] == 0
    assert fast["displaced_param_bytes"] == 0 and fast["predicted_exposed_optimizer_s"] > 0
    slow = policy.after_iteration(measured(**figures, cpu_optimizer_elements_per_s=4.4e8), current).decision
    assert slow["optim_sets_beyond_fit"] > 0 and slow["displaced_param_bytes"] > 0
    assert slow["optim_sets_moved_to_device"] == 2 + slow["optim_sets_beyond_fit"]
    stay = policy.after_iteration(measured(**{**figures, "h2d_bytes_per_s": 0}, cpu_optimizer_elements_per_s=4.4e8),
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
    enough for the window takes none, and without a link rate nothing changes."""
    from gemini_ext.placement.optimizer_lanes import RATE_SHARES_WHILE_BOTH_RUN, link_lane_sets
    s_cpu, s_link = RATE_SHARES_WHILE_BOTH_RUN
    on_host = [False] * 4 + [True] * 4
    figures = dict(set_shard_bytes=(200,) * 8, trainable=(True,) * 8, forward_seconds=1.0,
                   cpu_optimizer_elements_per_s=100.0, link_optimizer_elements_per_s=50.0)
    chosen, decision = link_lane_sets(measured(**figures), on_host)
    assert chosen == (6,)
    assert decision["predicted_exposed_cpu_only_s"] == pytest.approx(3.125)
    assert decision["predicted_exposed_with_link_s"] == pytest.approx(3 * 100 / (100 * s_cpu) - 0.875)
    # a link lane that keeps all its rate and a CPU that loses half: the link lane takes two sets
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("gemini_ext.placement.optimizer_lanes.RATE_SHARES_WHILE_BOTH_RUN", (0.5, 1.0))
        assert link_lane_sets(measured(**figures), on_host)[0] == (5, 7)
    chosen, decision = link_lane_sets(measured(**{**figures, "cpu_optimizer_elements_per_s": 1e4}), on_host)
    assert chosen == () and decision["link_lane_sets"] == 0
    assert link_lane_sets(measured(**{**figures, "link_optimizer_elements_per_s": 0.0}), on_host) == ((), {})


def test_where_the_host_steps_start_in_backward_the_link_lane_takes_sets_from_then_on():
    """The figures above with every host set stepping from backward on and a 1 s backward: the
    host sets are ready at 0.125 (set 7), 0.25, 0.375 and 0.5 s (set 4), and the next forward,
    from 1 s, reaches them at 1.5 (set 4) to 1.875 s. The CPU alone, taking the ready set the
    forward reaches first: 7, then 4, 5, 6, ending at 4.125 s, 2.375 s after the forward reached
    set 6. With the link lane at the shares (84 and 35 elements/s), each ready set to the lane
    that finishes it first: 7 and 6 on the CPU, 5 on the link lane (3.23 s against the CPU's
    3.70), 4 on the CPU, done at 3.70 s: the forward waits 2.20 s, for set 4."""
    from gemini_ext.placement.optimizer_lanes import link_lane_sets, two_lanes_from_backward
    on_host = [False] * 4 + [True] * 4
    figures = dict(set_shard_bytes=(200,) * 8, trainable=(True,) * 8, forward_seconds=1.0, backward_seconds=1.0,
                   cpu_optimizer_elements_per_s=100.0, link_optimizer_elements_per_s=50.0,
                   optimizer_steps_during_backward=True)
    assert two_lanes_from_backward([100] * 8, on_host, 1.0, 1.0, 100.0, 0.0) == ((), pytest.approx(2.375))
    chosen, decision = link_lane_sets(measured(**figures), on_host)
    assert chosen == (5,) and decision["predicted_exposed_cpu_only_s"] == pytest.approx(2.375)
    assert decision["predicted_exposed_with_link_s"] == pytest.approx(2 * 100 / 84 + 100 / 84 + 0.125 - 1.5)
    fast = measured(**{**figures, "cpu_optimizer_elements_per_s": 1e4})
    assert link_lane_sets(fast, on_host)[0] == (), "a CPU that keeps up alone needs no lane"


def test_a_split_is_checked_against_the_step_it_ran():
    """optimizer_lanes.rebalanced_link_sets on the figures above, with a 1.5 s forward of which
    0.5 s waited for the step (a 1 s window). The first split gave the link lane nothing (a long
    first forward), and the step measured the CPU alone at 100 elements/s: at the shares the link
    lane takes set 6, as it would have first. Both lanes measured at 60/s while both ran: sets 5
    and 7 go to the link lane, the wait falls from 5 - 0.875 to 3.33 - 0.75 s. A fast CPU needs no
    lane; a gain under the margin keeps the split; a window the wait filled leaves it unchecked.
    Sets the step stepped during its backward (speculation: the back two) are not the window's
    work: sets 4 and 5 are split between the lanes. Where every host set steps during the backward
    under way, the lane is given up."""
    from gemini_ext.placement import optimizer_lanes as lanes
    on_host = [False] * 4 + [True] * 4
    figures = dict(set_shard_bytes=(200,) * 8, trainable=(True,) * 8, forward_seconds=1.5,
                   forward_optimizer_wait_seconds=0.5, cpu_optimizer_elements_per_s=1e4,
                   link_optimizer_elements_per_s=50.0)
    chosen, checked = lanes.rebalanced_link_sets(measured(**figures, cpu_lane_elements_per_s_in_step=100.0),
                                                 on_host, ())
    assert chosen == (6,) and checked["forward_without_optimizer_wait_s"] == pytest.approx(1.0)
    assert checked["predicted_wait_kept_split_s"] == pytest.approx(3.125)
    both = dict(cpu_lane_elements_per_s_in_step=60.0, link_lane_elements_per_s_in_step=60.0)
    chosen, checked = lanes.rebalanced_link_sets(measured(**figures, **both), on_host, (6,))
    assert chosen == (5, 7) and checked["link_lane_sets"] == 2
    assert checked["predicted_wait_kept_split_s"] == pytest.approx(5 - 0.875)
    assert checked["predicted_wait_rebalanced_s"] == pytest.approx(200 / 60 - 0.75)
    assert lanes.rebalanced_link_sets(measured(**figures, **both), on_host, (5, 7))[0] == (5, 7)
    fast = dict(cpu_lane_elements_per_s_in_step=1e4, link_lane_elements_per_s_in_step=60.0)
    assert lanes.rebalanced_link_sets(measured(**figures, **fast), on_host, (6,))[0] == ()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lanes, "REBALANCE_MARGIN", 2.0)  # 2 s of the 1 s window: no gain is enough
        assert lanes.rebalanced_link_sets(measured(**figures, **both), on_host, (6,))[0] == (6,)
    filled = {**figures, "forward_optimizer_wait_seconds": 1.5}
    assert lanes.rebalanced_link_sets(measured(**filled, **both), on_host, (6,)) == ((6,), {})
    speculated = measured(**figures, **both, host_sets_stepped_in_backward=2)
    chosen, checked = lanes.rebalanced_link_sets(speculated, on_host, (6,))
    assert chosen == (5,) and checked["host_sets_stepped_in_backward"] == 2
    assert checked["predicted_wait_kept_split_s"] == pytest.approx(200 / 60 - 0.625)  # 100 elements a set
    assert checked["predicted_wait_rebalanced_s"] == pytest.approx(100 / 60 - 0.5)
    # every host set steps from backward on (a 1 s backward): the same check over backward and forward
    during = measured(**figures, **both, optimizer_steps_during_backward=True, backward_seconds=1.0)
    chosen, checked = lanes.rebalanced_link_sets(during, on_host, ())
    assert checked["host_sets_stepped_in_backward"] == 4 and chosen == lanes.two_lanes_from_backward(
        [100] * 8, on_host, 1.0, 1.0, 60.0, 60.0)[0] != ()
    assert checked["predicted_wait_rebalanced_s"] < checked["predicted_wait_kept_split_s"]


@pytest.mark.parametrize("case", ["clipped", "speculating"])
def test_auto_gives_up_the_link_lane_when_the_step_shows_the_cpu_keeps_up(monkeypatch, case):
    """End to end on sim with the probes replaced: a CPU probed at 10k elements/s and a link lane
    at 10k make the first decision split the host sets between them; the steps then run at the
    host's real speed, the CPU alone keeps up with the forward, and the check after the next step
    takes the lane away again (stats() and the runtime agree). Clipping keeps the steps at step();
    without it, a host with room for some sets' spares starts those sets' steps during backward
    (speculation), which must neither hide the step from the check nor count as its window's
    work. The copy probe's 0 keeps the state at what fits. Training matches torch throughout."""
    from gemini_ext.optim import wrapper
    from gemini_ext.placement import optimizer_lanes, rates as _rates
    monkeypatch.setitem(_rates._cache, "cpu", 1e4)
    monkeypatch.setattr(_rates, "link_optimizer_elements_per_s", lambda device: 1e4)
    monkeypatch.setattr(_rates, "h2d_bytes_per_s", lambda device: 0.0)
    max_norm = 0.05 if case == "clipped" else 0.0
    speculation = "in_place"
    if case == "speculating":  # room for one or two sets' spares, not every host set's
        monkeypatch.setattr(wrapper, "host_available_bytes", lambda ranks=1: 6 * CHUNK_BYTES)
        speculation = "spares"
    model, reference = make_models()
    train_reference(reference, 6, torch.device("cpu"), max_norm=max_norm)
    _, stats = train_gemini(model, 6, config("sim", placement_policy="auto", sim_capacity=40 * CHUNK_BYTES,
                                             max_norm=max_norm, host_step_speculation=speculation))
    decision = stats["placement"]["decision"]
    assert decision["link_lane_sets"] > 0 and decision["predicted_exposed_cpu_only_s"] > 0, decision
    assert decision["lane_rebalances"] == optimizer_lanes.REBALANCES
    assert decision["rebalance_link_lane_sets"] == 0 and stats["placement"]["optim_chunks_link_lane"] == 0
    assert decision["rebalance_cpu_lane_elements_per_s_in_step"] > 1e4
    speculated = decision["rebalance_host_sets_stepped_in_backward"]
    if case == "speculating":
        assert stats["placement"]["host_steps"]["during_backward"] == "some sets", stats["placement"]
        assert 0 < speculated < stats["placement"]["optim_chunks_on_host"], decision
    else:
        assert speculated == 0
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


def test_the_cpu_probe_outgrows_the_last_level_cache(tmp_path):
    """The CPU optimizer's probe steps arrays several times the largest cache (sysfs), within
    its bounds: a probe of 64 MiB of arrays read twice the kernel's rate over real state."""
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
