"""Which host-stepped chunk sets `auto` gives to the link lane: the device's optimizer kernel
reading and writing their pinned host state in place over the link, beside the CPU kernel
stepping the others (the Note in csrc/torch/optim/hybrid_optimizer.h).

Where the host holds optimizer state the device has no room for, the CPU step of that state is
on the critical path whenever it outlasts what it overlaps: the next forward, which reaches the
host sets (the back of the execution order) last. The two kernels compute the same bits, and on
the H200's host the host's memory gives both of them bandwidth at once (bench/link_adam.py: 4.3G
parameters/s on the CPU alone, 1.8G on the device over the link alone, 5.1G together with 30%
on the device), so splitting the host sets between them shortens the step.

The split is list scheduling with the measured rates (placement/rates.py), each lane at the share
of its rate it keeps while the other runs (RATE_SHARES_WHILE_BOTH_RUN): the host sets in forward
order, each to the lane that would finish it first; the predicted wait of the forward is as
optimizer_split.predicted_exposed_optimizer_seconds counts it (the forward waits wherever it
reaches a set before its step ended). The rates are probed one lane at a time, but in the step
the lanes share the host's memory with each other and with the uploads of the stepped
parameters; on the H200's host, in the 15.4B GPT's step at 16k tokens, the CPU kept 0.84 of its
probed rate and the link lane 0.70. Splitting with the probed rates gave the link lane one set
too many there (it ended last, about 0.1 s after the CPU). The shares vary with the host: in a
later run on the same kind of machine they were 0.58-0.65 and 0.61-0.68, both lanes together
stepping 4.5G parameters/s against 6.2G in the first. No lane where the CPU alone is predicted
not to be waited for (the link carries the forward's fetches too) or where a rate was not measured.

Where every host set's step starts during backward (the in-place guess, the step in backward),
the sets are ready as backward completes them (from the back, at their share of the pass) and
the lanes take them from then on: whichever lane would finish the ready set the next forward
reaches first takes it, and the forward waits wherever it reaches a set before its step ended
(two_lanes_from_backward; the CPU alone: optimizer_split's model of the same window). The
link lane steps guessed sets as the CPU does, with the same bits (the Note in
csrc/torch/optim/hybrid_optimizer_in_place.cpp); the spare copies' speculation stays on the CPU.

After the step of a split ran, the split is checked again from what that step measured
(rebalanced_link_sets): each lane's elements over its kernel seconds in the step, and the next
forward's duration less the time it was blocked on the host steps (the first forward's wall
time, which the first split reads, carries the first iteration's one-off costs: between 0.3 and
1.8 s for a 0.76 s forward on the same row). Where both lanes stepped, their rates are those
while both ran; a lane that had no sets gets its rate (measured alone in the step, or probed)
times its share. Where the CPU alone would not be waited for, the lane is given up; otherwise
a new split is taken only where it predicts a wait shorter by REBALANCE_MARGIN of the forward
(at least REBALANCE_MARGIN_MIN_S). At most REBALANCES checks per decision; which lane steps a
set moves no data, so a change costs nothing but the next step's time. The step's figures are
taken when the next backward begins (every set of it settled by the forward in between), before
that backward launches speculative steps, which stay pending until step(); the sets a step
started during its backward (speculation, the back of the model) are left out of the window's
work. Where every host set's step starts during the backward under way, the check is the same
over backward and the next forward (two_lanes_from_backward).
"""

from __future__ import annotations

import itertools

from .optimizer_split import predicted_exposed_optimizer_seconds, ready_from_backward

RATE_SHARES_WHILE_BOTH_RUN = (0.84, 0.70)  # (CPU, link lane): of each probed rate, while both step (H200 host)
REBALANCES = 3              # checks of a split against its measured step, per decision
REBALANCE_MARGIN = 0.02     # of the forward: the least predicted gain a new split must bring
REBALANCE_MARGIN_MIN_S = 0.01


def lanes_wait_seconds(elements: list[int], on_host: list[bool], link_sets, window_seconds: float,
                       cpu_elements_per_s: float, link_elements_per_s: float,
                       shares: tuple = RATE_SHARES_WHILE_BOTH_RUN) -> float:
    """The next forward's wait for host sets stepped by the CPU and (`link_sets`) the link lane,
    each lane in forward order at its rate times its share while both run (`shares`; (1, 1)
    for rates measured while both ran)."""
    cpu, link = cpu_elements_per_s * shares[0], link_elements_per_s * shares[1]
    total, before, waited, cpu_free, link_free = sum(elements) or 1, 0, 0.0, 0.0, 0.0
    for index, (n, host) in enumerate(zip(elements, on_host)):
        if host:
            if index in link_sets:
                link_free += n / link
                done = link_free
            else:
                cpu_free += n / cpu
                done = cpu_free
            waited = max(waited, done - window_seconds * before / total)
        before += n
    return waited


def _list_scheduled(elements: list[int], on_host: list[bool], cpu: float, link: float) -> tuple:
    """The host sets, in forward order, each to the lane that would finish it first (a tie stays
    on the CPU), at the rates `cpu` and `link` (elements/s, while both run): the link lane's."""
    cpu_free = link_free = 0.0  # when each lane finishes what it was given so far
    chosen = []
    for index, (n, host) in enumerate(zip(elements, on_host)):
        if host:
            if link_free + n / link < cpu_free + n / cpu:
                link_free += n / link
                chosen.append(index)
            else:
                cpu_free += n / cpu
    return tuple(chosen)


def two_lanes_from_backward(elements: list[int], on_host: list[bool], backward_s: float, forward_s: float,
                            cpu: float, link: float) -> tuple[tuple, float]:
    """(the link lane's sets, the next forward's predicted wait) where the host sets step from
    backward on (the module's note) at the rates `cpu` and `link` (elements/s, while both run);
    `link` 0: the CPU alone."""
    total = sum(elements) or 1
    ready = ready_from_backward(elements, on_host, backward_s)
    before = [0, *itertools.accumulate(elements)]  # elements ahead of each set in forward order
    free, chosen, waited = [0.0, 0.0], [], 0.0  # when each lane (CPU, link) finishes what it took
    rates = (cpu, link)
    while ready:
        clock = max(min(free if link > 0 else free[:1]), min(ready.values()))
        i = min(j for j, t in ready.items() if t <= clock)  # the most urgent ready set
        finish = [max(free[k], ready[i]) + elements[i] / rates[k] if rates[k] > 0 else float("inf") for k in (0, 1)]
        lane = 1 if finish[1] < finish[0] else 0  # a tie stays on the CPU
        free[lane] = finish[lane]
        if lane:
            chosen.append(i)
        del ready[i]
        waited = max(waited, finish[lane] - (backward_s + forward_s * before[i] / total))
    return tuple(sorted(chosen)), waited


def lanes_wait_from_backward(elements: list[int], on_host: list[bool], link_sets, backward_s: float,
                             forward_s: float, cpu: float, link: float) -> float:
    """The next forward's wait where the host sets step from backward on, `link_sets` on the link
    lane at `link` elements/s and the others on the CPU at `cpu`, each lane taking its ready set
    the forward reaches first (the module's note)."""
    total = sum(elements) or 1
    before, ready = [0, *itertools.accumulate(elements)], ready_from_backward(elements, on_host, backward_s)
    waited = 0.0
    for lane, rate in ((True, link), (False, cpu)):
        mine, clock = {i: t for i, t in ready.items() if (i in link_sets) == lane}, 0.0
        while mine:
            now = [i for i, t in mine.items() if t <= clock]
            if not now:
                clock = min(mine.values())
                continue
            i = min(now)
            del mine[i]
            clock += elements[i] / rate
            waited = max(waited, clock - (backward_s + forward_s * before[i] / total))
    return waited


def _from_backward(m, on_host: list[bool], elements: list[int], cpu: float, link: float, forward_s: float,
                   shares: tuple) -> tuple[tuple, dict]:
    """link_lane_sets where every host set steps from backward on (the module's note)."""
    cpu_only = two_lanes_from_backward(elements, on_host, m.backward_seconds, forward_s, cpu, 0.0)[1]
    figures = {"link_optimizer_elements_per_s": link, "predicted_exposed_cpu_only_s": cpu_only}
    if cpu_only <= 0:
        return (), {**figures, "link_lane_sets": 0}
    chosen, waited = two_lanes_from_backward(elements, on_host, m.backward_seconds, forward_s, cpu * shares[0],
                                             link * shares[1])
    return chosen, {**figures, "link_lane_sets": len(chosen), "predicted_exposed_with_link_s": waited}


def link_lane_sets(m, on_host: list[bool]) -> tuple[tuple, dict]:
    """(the sets the link lane steps, the figures of the decision) for measurements `m`
    (policies.Measurements) and the host sets `on_host` (per set, in execution order)."""
    cpu, link, window = m.cpu_optimizer_elements_per_s, m.link_optimizer_elements_per_s, m.forward_seconds
    if not (cpu > 0 and link > 0 and window > 0) or not any(on_host):
        return (), {}
    elements = [b // m.compute_itemsize for b in m.set_shard_bytes]
    if m.optimizer_steps_during_backward:
        if m.backward_seconds <= 0:
            return (), {}
        return _from_backward(m, on_host, elements, cpu, link, window, RATE_SHARES_WHILE_BOTH_RUN)
    cpu_only = predicted_exposed_optimizer_seconds(elements, on_host, window, cpu, during_backward=False)
    figures = {"link_optimizer_elements_per_s": link, "predicted_exposed_cpu_only_s": cpu_only}
    if cpu_only <= 0:
        return (), {**figures, "link_lane_sets": 0}
    shares = RATE_SHARES_WHILE_BOTH_RUN
    chosen = _list_scheduled(elements, on_host, cpu * shares[0], link * shares[1])
    waited = lanes_wait_seconds(elements, on_host, set(chosen), window, cpu, link)
    return chosen, {**figures, "link_lane_sets": len(chosen), "predicted_exposed_with_link_s": waited}


def stepped_at_step(on_host: list[bool], stepped_in_backward: int) -> list[bool]:
    """The host sets (`on_host`, in execution order) whose steps are left for the window after
    step(), where `stepped_in_backward` of them were stepped during the backward before it: those
    whose gradients reached the host first, the back of the model (the speculation's choice)."""
    left = list(on_host)
    for index in reversed(range(len(left))):
        if stepped_in_backward <= 0:
            break
        if left[index]:
            left[index] = False
            stepped_in_backward -= 1
    return left


def rebalanced_link_sets(m, on_host: list[bool], current: tuple) -> tuple[tuple, dict]:
    """(the sets the link lane steps from the next step on, the figures of the check) after a
    step under the split `current`, from that step's lane rates and the forward that followed
    it in `m` (the module's note); `current` itself, with no figures, where nothing was measured.
    The sets that step stepped during its backward (speculation) are not the window's work; where
    every host set's step starts during the backward now under way, the lane is given up (the CPU
    steps them there)."""
    window = m.forward_seconds - m.forward_optimizer_wait_seconds
    cpu_in, link_in = m.cpu_lane_elements_per_s_in_step, m.link_lane_elements_per_s_in_step
    if window <= 0 or not any(on_host) or not (cpu_in > 0 or link_in > 0):
        return tuple(current), {}
    s_cpu, s_link = RATE_SHARES_WHILE_BOTH_RUN
    if cpu_in > 0 and link_in > 0:  # both stepped: their rates while both ran
        cpu, link, cpu_alone = cpu_in, link_in, cpu_in / s_cpu
    else:
        cpu_alone = cpu_in or m.cpu_optimizer_elements_per_s
        cpu, link = cpu_alone * s_cpu, (link_in or m.link_optimizer_elements_per_s) * s_link
    if not (cpu > 0 and link > 0):
        return tuple(current), {}
    elements = [b // m.compute_itemsize for b in m.set_shard_bytes]
    if m.optimizer_steps_during_backward:
        return _rebalanced_from_backward(m, on_host, elements, current, window, (cpu, link, cpu_alone), cpu_in,
                                         link_in)
    at_step = stepped_at_step(on_host, m.host_sets_stepped_in_backward)
    cpu_only = predicted_exposed_optimizer_seconds(elements, at_step, window, cpu_alone, during_backward=False)
    chosen = _list_scheduled(elements, at_step, cpu, link) if cpu_only > 0 else ()
    both = (1.0, 1.0)
    now = (lanes_wait_seconds(elements, at_step, set(current), window, cpu, link, both) if current else
           predicted_exposed_optimizer_seconds(elements, at_step, window, cpu_alone, during_backward=False))
    new = lanes_wait_seconds(elements, at_step, set(chosen), window, cpu, link, both) if chosen else cpu_only
    if chosen and new >= now - max(REBALANCE_MARGIN * window, REBALANCE_MARGIN_MIN_S):
        chosen = tuple(current)  # not worth a change (a CPU alone that is not waited for needs no lane)
    return chosen, {"forward_without_optimizer_wait_s": window, "measured_optimizer_wait_s":
                    m.forward_optimizer_wait_seconds, "cpu_lane_elements_per_s_in_step": cpu_in,
                    "link_lane_elements_per_s_in_step": link_in, "host_sets_stepped_in_backward":
                    sum(on_host) - sum(at_step), "predicted_wait_kept_split_s": now,
                    "predicted_wait_rebalanced_s": new, "link_lane_sets": len(chosen)}


def _rebalanced_from_backward(m, on_host, elements, current: tuple, window: float, rates: tuple, cpu_in: float,
                              link_in: float) -> tuple[tuple, dict]:
    """rebalanced_link_sets where every host set steps from backward on: the split that model
    predicts against the one kept, at the step's rates (`rates`: CPU and link while both run, the
    CPU alone)."""
    cpu, link, cpu_alone = rates
    backward = m.backward_seconds

    cpu_only = two_lanes_from_backward(elements, on_host, backward, window, cpu_alone, 0.0)[1]
    chosen = two_lanes_from_backward(elements, on_host, backward, window, cpu, link)[0] if cpu_only > 0 else ()
    now = lanes_wait_from_backward(elements, on_host, set(current), backward, window, cpu if current else cpu_alone,
                                   link)
    new = lanes_wait_from_backward(elements, on_host, set(chosen), backward, window, cpu if chosen else cpu_alone, link)
    if new >= now - max(REBALANCE_MARGIN * window, REBALANCE_MARGIN_MIN_S):
        chosen = tuple(current)
    return chosen, {"forward_without_optimizer_wait_s": window, "measured_optimizer_wait_s":
                    m.forward_optimizer_wait_seconds, "cpu_lane_elements_per_s_in_step": cpu_in,
                    "link_lane_elements_per_s_in_step": link_in, "host_sets_stepped_in_backward": sum(on_host),
                    "predicted_wait_kept_split_s": now, "predicted_wait_rebalanced_s": new,
                    "link_lane_sets": len(chosen)}
