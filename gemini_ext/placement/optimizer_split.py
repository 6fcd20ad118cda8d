"""How much optimizer state `auto` moves to the device beyond what fits beside the parameter
chunks, from rates measured on the machine (gemini_ext/placement/rates.py) and the last iteration's passes.

Where the state of every set does not fit beside the parameter chunks, auto first moves that of
as many sets as fit (from the front: their gradients complete last in backward, so a CPU step
there would be exposed). Beyond that, each further set's state on the device displaces
parameter chunks, which are then evicted and fetched again every iteration. auto weighs the two
with rates measured on the machine (gemini_ext/placement/rates.py) and the last forward and backward passes:
 - the CPU optimizer's time on the critical path (predicted_exposed_optimizer_seconds). Where
   the optimizer starts host steps during backward (speculation: no clipping, or the last norm
   under max_norm), host sets are stepped in the order their gradients complete (from the back
   of the execution order), each no earlier than the share of the backward pass done by then
   (in elements), one after another at the measured CPU rate; what runs past the backward's end
   is exposed. Otherwise the steps start at step() and overlap the next forward, which reaches
   the host sets (the back of the execution order) last: they run in forward order and the
   forward waits wherever it reaches a set before its step ended;
 - the displaced bytes' fetches: DISPLACED_FETCH_COST times the bytes over the measured
   host-to-device rate (fetched in forward and again in backward, and a fetch under eviction
   stalls compute: on the H200, 1.34B at 24 GiB, displacing 2.7 GB cost 444 ms a step, about
   4x what two fetches at the copy rate would take);
and moves the count of further sets (possibly none) that minimises their sum: it stops where
the CPU step no longer outlasts the pass it overlaps or where the fetches would cost more than
the CPU time they save. A fast host (the H200's 16 cores) never displaces: there a further set
saves tens of milliseconds of CPU and costs over a hundred in fetches. Not weighed when the host cannot
hold every state (those sets' parameter chunks are never evicted) or the parameters do not fit.
"""

from __future__ import annotations

import itertools

DISPLACED_FETCH_COST = 8  # two fetches per iteration, each about 4x a bare copy under eviction


def predicted_exposed_optimizer_seconds(set_elements: list[int], on_host: list[bool], window_seconds: float,
                                        cpu_elements_per_s: float, during_backward: bool = True,
                                        forward_seconds: float = 0.0) -> float:
    """The CPU optimizer's time on the critical path (the module's note). `set_elements` and
    `on_host` in execution order; `window_seconds` the backward pass (`during_backward`) or the
    next forward pass that the steps overlap. During backward with `forward_seconds`, the steps
    still running when backward ends overlap the next forward too, which waits wherever it
    reaches a set before its step ended (without: what runs past the backward is exposed)."""
    total = sum(set_elements) or 1
    if during_backward and forward_seconds > 0:
        return _waited_from_backward(set_elements, on_host, window_seconds, forward_seconds, cpu_elements_per_s)
    if during_backward:  # gradients complete from the back; the steps follow them
        done, finished = 0, 0.0
        for n, host in zip(reversed(set_elements), reversed(on_host)):
            done += n
            if host:
                finished = max(finished, window_seconds * done / total) + n / cpu_elements_per_s
        return max(0.0, finished - window_seconds)
    before, finished, waited = 0, 0.0, 0.0  # from step(): the forward reaches a set after `before`
    for n, host in zip(set_elements, on_host):
        if host:
            finished += n / cpu_elements_per_s
            waited = max(waited, finished - window_seconds * before / total)
        before += n
    return waited


def ready_from_backward(set_elements, on_host, backward_s: float) -> dict:
    """{host set: when backward completes its gradients}: from the back, at its share of the pass
    (in elements)."""
    total = sum(set_elements) or 1
    ready, done = {}, 0
    for i in reversed(range(len(set_elements))):
        done += set_elements[i]
        if on_host[i]:
            ready[i] = backward_s * done / total
    return ready


def _waited_from_backward(set_elements, on_host, backward_s, forward_s, cpu_rate) -> float:
    """Host sets ready as backward completes them (ready_from_backward), the CPU taking the ready
    set the next forward reaches first (the optimizer thread's order); the forward starts when
    backward ends and waits wherever it reaches a set before its step ended."""
    total = sum(set_elements) or 1
    ready = ready_from_backward(set_elements, on_host, backward_s)
    clock, waited = 0.0, 0.0
    before = [0, *itertools.accumulate(set_elements)]  # elements ahead of each set in forward order
    while ready:
        now = [i for i, t in ready.items() if t <= clock]
        if not now:
            clock = min(ready.values())
            continue
        i = min(now)  # the most urgent for the next forward
        del ready[i]
        clock += set_elements[i] / cpu_rate
        waited = max(waited, clock - (backward_s + forward_s * before[i] / total))
    return waited


def beyond_fit_by_rates(m, on_device: set, remaining: int, state_per_element: int) -> tuple[set, dict]:
    """The trainable sets beyond `on_device` (those that fit beside the parameters, `remaining`
    bytes left) whose state moves to the device anyway, displacing parameter chunks, where the
    measured rates in `m` (policy.Measurements) say the CPU time saved outweighs the fetches;
    with the figures for the decision. Nothing when a rate was not measured."""
    window = m.backward_seconds if m.optimizer_steps_during_backward else m.forward_seconds
    if not (window > 0 and m.cpu_optimizer_elements_per_s > 0 and m.h2d_bytes_per_s > 0):
        return set(), {}
    elements = [b // m.compute_itemsize for b in m.set_shard_bytes]
    movable = [i for i, t in enumerate(m.trainable) if t and i not in on_device]  # from the front
    param_bytes = sum(m.set_shard_bytes)
    best, best_seconds, best_figures = 0, None, None
    extra_bytes = 0
    for count in range(len(movable) + 1):
        if count:
            extra_bytes += elements[movable[count - 1]] * state_per_element
        displaced = max(0, extra_bytes - remaining)
        if displaced > param_bytes - max(m.set_shard_bytes):  # nothing left to evict
            break
        moved = on_device | set(movable[:count])
        on_host = [t and i not in moved for i, t in enumerate(m.trainable)]
        exposed = predicted_exposed_optimizer_seconds(elements, on_host, window, m.cpu_optimizer_elements_per_s,
                                                      m.optimizer_steps_during_backward)
        fetches = DISPLACED_FETCH_COST * displaced / m.h2d_bytes_per_s
        if best_seconds is None or exposed + fetches < best_seconds:
            best, best_seconds = count, exposed + fetches
            best_figures = {"predicted_exposed_optimizer_s": exposed, "predicted_fetch_s": fetches,
                            "displaced_param_bytes": displaced}
    return set(movable[:best]), {"forward_seconds": m.forward_seconds, "backward_seconds": m.backward_seconds,
                                 "optimizer_window": ("backward" if m.optimizer_steps_during_backward
                                                      else "next forward"),
                                 "cpu_optimizer_elements_per_s": m.cpu_optimizer_elements_per_s,
                                 "h2d_bytes_per_s": m.h2d_bytes_per_s, "optim_sets_beyond_fit": best,
                                 **best_figures}
