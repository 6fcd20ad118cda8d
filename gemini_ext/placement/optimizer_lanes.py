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
not to be waited for (the link carries the forward's fetches too), where steps start during
backward (speculation: the CPU lane's spares), or where a rate was not measured.
"""

from __future__ import annotations

from .optimizer_split import predicted_exposed_optimizer_seconds

RATE_SHARES_WHILE_BOTH_RUN = (0.84, 0.70)  # (CPU, link lane): of each probed rate, while both step (H200 host)


def lanes_wait_seconds(elements: list[int], on_host: list[bool], link_sets, window_seconds: float,
                       cpu_elements_per_s: float, link_elements_per_s: float) -> float:
    """The next forward's wait for host sets stepped by the CPU and (`link_sets`) the link lane,
    each lane in forward order at its probed rate times its share while both run."""
    cpu = cpu_elements_per_s * RATE_SHARES_WHILE_BOTH_RUN[0]
    link = link_elements_per_s * RATE_SHARES_WHILE_BOTH_RUN[1]
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


def link_lane_sets(m, on_host: list[bool]) -> tuple[tuple, dict]:
    """(the sets the link lane steps, the figures of the decision) for measurements `m`
    (policies.Measurements) and the host sets `on_host` (per set, in execution order)."""
    cpu, link, window = m.cpu_optimizer_elements_per_s, m.link_optimizer_elements_per_s, m.forward_seconds
    if m.optimizer_steps_during_backward or not (cpu > 0 and link > 0 and window > 0) or not any(on_host):
        return (), {}
    elements = [b // m.compute_itemsize for b in m.set_shard_bytes]
    cpu_only = predicted_exposed_optimizer_seconds(elements, on_host, window, cpu, during_backward=False)
    figures = {"link_optimizer_elements_per_s": link, "predicted_exposed_cpu_only_s": cpu_only}
    if cpu_only <= 0:
        return (), {**figures, "link_lane_sets": 0}
    cpu_shared, link_shared = cpu * RATE_SHARES_WHILE_BOTH_RUN[0], link * RATE_SHARES_WHILE_BOTH_RUN[1]
    cpu_free = link_free = 0.0  # when each lane finishes what it was given so far
    chosen = []
    for index, (n, host) in enumerate(zip(elements, on_host)):
        if host:
            if link_free + n / link_shared < cpu_free + n / cpu_shared:
                link_free += n / link_shared
                chosen.append(index)
            else:
                cpu_free += n / cpu_shared
    waited = lanes_wait_seconds(elements, on_host, set(chosen), window, cpu, link)
    return tuple(chosen), {**figures, "link_lane_sets": len(chosen), "predicted_exposed_with_link_s": waited}
