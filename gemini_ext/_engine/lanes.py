"""The lanes of the last step: how long each resource was busy, and which one bounds the step
(engine.stats()["lanes"]).

[Note: the lanes of a step]
A step is timed from one optimizer step to the next (_engine/throughput.py). Within it:
- gpu: the forward and backward passes' wall time less what they waited for (chunks fetched on
  demand, host steps still running): the device's compute, as the host saw it;
- h2d, d2h: the chunks' copies each way, their bytes over the link's measured rate (the
  placement's probe; None before it ran);
- cpu: the host sets' optimizer steps on the optimizer thread (the CPU lane);
- link: the link lane's steps, the device's kernel over pinned host state;
- device_optimizer: the device-held sets' steps.
Beside the seconds, what each lane moved: the copies' bytes each way and the optimizer lanes'
elements (`bytes`, `elements`). The waits are the passes' (for chunks, for host steps) and the
last `optimizer.step()` call's wall time (`step_call`: what its caller waited). The
bound is the busiest lane; each other lane idles the step's time less its own. The lanes overlap,
so their sum may exceed the step. A lane the step did not use gets the reason (`unused`), from
the placement's decision.
"""

from __future__ import annotations

LANES = ("gpu", "h2d", "d2h", "cpu", "link", "device_optimizer")


def summary(steps: list, last_step: dict | None, throughput: dict, decision: dict, step_call_seconds: float) -> dict:
    """`steps`: the tracer's iterations, the last one's traffic, waits and passes; `last_step`: the
    optimizer's last step whose host steps all finished (Placer.last_settled_step); `throughput`:
    its summary (the median step); `decision`: the placement's (the link's measured rate);
    `step_call_seconds`: the last optimizer.step() call's wall time."""
    # see [Note: the lanes of a step]
    step_seconds, h2d_bytes_per_s = throughput["step_seconds"], decision.get("h2d_bytes_per_s")
    step = steps[-1] if steps else None
    if not step or not last_step:
        return {"busy_seconds": None, "waits": None, "step_seconds": step_seconds, "bound": None, "idle_seconds": None,
                "line": "no step yet"}
    waits = {"chunks": step["wait_seconds"], "host_steps": step["optimizer_wait_seconds"],
             "step_call": step_call_seconds}
    passes = step["forward_seconds"] + step["backward_seconds"]
    rate = h2d_bytes_per_s or None
    busy = {"gpu": max(0.0, passes - waits["chunks"] - waits["host_steps"]),
            "h2d": step["h2d_bytes"] / rate if rate else None,
            "d2h": step["d2h_bytes"] / rate if rate else None,  # the link's rate either way (pinned)
            "cpu": last_step["host_seconds"], "link": last_step["link_seconds"],
            "device_optimizer": last_step["device_seconds"]}
    known = {k: v for k, v in busy.items() if v is not None}
    bound = max(known, key=known.get)
    whole = step_seconds if step_seconds else max(known.values())
    idle = {k: max(0.0, whole - v) for k, v in known.items() if k != bound}
    line = f"{bound} bounds the step: busy {known[bound]:.3f} s of {whole:.3f} s; " + ", ".join(
        f"{k} idles {v:.3f} s ({v / whole:.0%})" for k, v in idle.items() if whole > 0)
    moved = {"bytes": {"h2d": step["h2d_bytes"], "d2h": step["d2h_bytes"]},
             "elements": {"cpu": last_step["host_params"], "link": last_step["link_params"],
                          "device_optimizer": last_step["device_params"]}}
    return {"busy_seconds": busy, **moved, "waits": waits, "step_seconds": step_seconds, "bound": bound,
            "idle_seconds": idle, "unused": _unused(busy, last_step, decision), "line": line}


def _unused(busy: dict, last_step: dict, decision: dict) -> dict:
    """Why each lane the step did not use stayed idle."""
    why = {}
    if last_step["host_params"] == 0:
        why["cpu"] = "no set's optimizer state is on the host, or the link lane stepped every one"
    if last_step["device_params"] == 0:
        why["device_optimizer"] = "no set's optimizer state is on the device"
    if last_step["link_params"] == 0:
        sets = decision.get("rebalance_link_lane_sets", decision.get("link_lane_sets"))
        if "link_optimizer_elements_per_s" not in decision:
            why["link"] = "not weighed: no measured link rate, or a placement other than auto"
        elif decision.get("predicted_exposed_cpu_only_s", 0.0) <= 0 or not sets:
            why["link"] = "the CPU alone is predicted to finish before the next forward needs its sets"
        else:
            why["link"] = f"the split gave it {sets} set(s), none stepped in this step"
    for lane in ("h2d", "d2h"):
        if busy[lane] is None:
            why[lane] = "the link's rate was not measured (auto measures it on cuda)"
    return why
