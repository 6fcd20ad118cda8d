"""Which host-stepped chunk sets `auto` gives to the link lane: the device's optimizer kernel
reading and writing their pinned host state in place over the link, beside the CPU kernel
stepping the others (the Note in csrc/torch/optim/hybrid_optimizer.h).

Where the host holds optimizer state the device has no room for, the CPU step of that state is
on the critical path whenever it outlasts what it overlaps: the next forward, which reaches the
host sets (the back of the execution order) last. The two kernels compute the same bits, and on
the H200's host the host's memory gives both of them bandwidth at once (bench/link_adam.py: 4.3G
parameters/s on the CPU alone, 1.8G on the device over the link alone, 5.1G together with 30%
on the device), so splitting the host sets between them shortens the step.

The split is list scheduling with the measured rates (placement/rates.py): the host sets in forward
order, each to the lane that would finish it first; the predicted wait of the forward is as
optimizer_split.predicted_exposed_optimizer_seconds counts it (the forward waits wherever it
reaches a set before its step ended). No lane where the CPU alone is predicted not to be waited
for (the link carries the forward's fetches too), where steps start during backward
(speculation: the CPU lane's spares), or where a rate was not measured.
"""

from __future__ import annotations

from .optimizer_split import predicted_exposed_optimizer_seconds


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
    total = sum(elements) or 1
    cpu_free = link_free = 0.0  # when each lane finishes what it was given so far
    chosen, before, waited = [], 0, 0.0
    for index, (n, host) in enumerate(zip(elements, on_host)):
        if host:
            if link_free + n / link < cpu_free + n / cpu:
                link_free += n / link
                chosen.append(index)
                done = link_free
            else:
                cpu_free += n / cpu
                done = cpu_free
            waited = max(waited, done - window * before / total)
        before += n
    return tuple(chosen), {**figures, "link_lane_sets": len(chosen), "predicted_exposed_with_link_s": waited}
