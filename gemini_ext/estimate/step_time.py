"""The step time gx.estimate predicts from the engine's plan (engine_plan.py) and the target's rates
(target.py).

[Note: the step-time model]
A step is the GPU's work plus what the GPU waits for:
  step = gpu + device_optimizer + gradients_tail + optimizer_wait + fetch_stall + activation_copies
- gpu: the model's FLOPs per step (2 N forward, 2 N of recomputation for each recomputed block's
  share, 2 N + 2 N_trainable backward) at the GPU's dense 16-bit peak times an efficiency that grows
  with the tokens per step (target.GPU_EFFICIENCY, taken at 1024-token sequences, so attention's
  work at that length is inside it), or at `gpu_flops_per_s=`, a rate measured for the model at hand
  (another implementation of the same blocks runs at another fraction of the peak). At few tokens
  per step the host's dispatch of each pass bounds it: HOST_DISPATCH_S_PER_TENSOR_PASS per parameter
  tensor and pass (forward, the recomputed forward, backward). Longer sequences add the attention
  scores' work beyond ATTENTION_BASE_SEQ: per token, layer and causal forward 2 d (s - base) FLOPs,
  in the forward, the recomputed forward and the backward (ATTENTION_BACKWARD_PER_FORWARD forwards).
- device_optimizer: the fused Adam kernel over the device-held state between backward and the next
  forward: 28 bytes per element (20 with bf16 moments, 14 with the 8-byte state) at
  DEVICE_OPTIMIZER_BYTES_PER_S.
- optimizer_wait: the host-held sets' steps as placement/optimizer_split.py and optimizer_lanes.py
  schedule them (the policy's own functions): from the backward on under optimizer_step_in_backward,
  else from step() on, on the CPU and the link lane, and the next forward waits where it reaches a
  set before its step ended.
- gradients_tail: without steps in backward, step() starts the host steps once every gradient is on
  the host; what the host sets' gradient copies take beyond the backward pass comes first.
- fetch_stall: parameter bytes the chunks' budget cannot hold beside the device-held state are
  evicted and fetched again, counted once at the link's rate.
- activation_copies: what the offloaded inputs' copies add beyond the blocks' passes (the core's
  plan's own figure).
PCIe traffic (the host sets' parameters up, their gradients down) overlaps compute; it is reported
as a bound, not added.
"""

from __future__ import annotations

from ..placement.optimizer_lanes import RATE_SHARES_WHILE_BOTH_RUN, lanes_wait_from_backward, lanes_wait_seconds
from ..placement.optimizer_split import predicted_exposed_optimizer_seconds
from . import target
from .engine_plan import chunk_bytes, device_state_elements, displaced_param_bytes

DEVICE_OPTIMIZER_BYTES_PER_ELEMENT = {("fp32", True): 28, ("fp32", False): 28, ("bf16", True): 20, ("bf16", False): 14}


def attention_forward_flops(shape, rank_tokens: int, seq_len: int | None) -> float:
    """The causal forward's attention-score FLOPs beyond ATTENTION_BASE_SEQ-token sequences."""
    if seq_len is None or shape is None:
        return 0.0
    return 2.0 * shape.width * max(0, seq_len - target.ATTENTION_BASE_SEQ) * rank_tokens * shape.layers


def gpu_seconds(rank_tokens: int, n_total: int, n_trainable: int, recomputed_share: float, rate: float,
                tensors: int, attention_flops: float = 0.0) -> tuple[float, float]:
    """(the GPU's forward and backward with `recomputed_share` of the forward run again, the forward
    alone): FLOPs at `rate` (FLOP/s), or the host's dispatch where that is longer."""
    forward_flops = rank_tokens * 2 * n_total + attention_flops
    flops = (forward_flops * (1 + recomputed_share) + rank_tokens * (2 * n_total + 2 * n_trainable) +
             attention_flops * target.ATTENTION_BACKWARD_PER_FORWARD)
    dispatch = tensors * target.HOST_DISPATCH_S_PER_TENSOR_PASS
    return (max(flops / rate, (2 + recomputed_share) * dispatch), max(forward_flops / rate, dispatch))


def optimizer_wait(m, chosen, backward_s: float, forward_s: float, cpu_rate: float) -> float:
    """The next forward's wait for the host sets' steps (the policy's own schedulers)."""
    elements, on_host = device_state_elements(m, chosen)
    if m.optimizer_steps_during_backward and chosen.link_sets:  # both lanes from backward on
        shares = RATE_SHARES_WHILE_BOTH_RUN
        return lanes_wait_from_backward(elements, on_host, set(chosen.link_sets), backward_s, forward_s,
                                        cpu_rate * shares[0], target.LINK_ELEMENTS_PER_S * shares[1])
    if m.optimizer_steps_during_backward:  # from backward on, in the order the gradients complete
        return predicted_exposed_optimizer_seconds(elements, on_host, backward_s, cpu_rate, during_backward=True,
                                                   forward_seconds=forward_s)
    if chosen.link_sets:
        return lanes_wait_seconds(elements, on_host, set(chosen.link_sets), forward_s, cpu_rate,
                                  target.LINK_ELEMENTS_PER_S)
    return predicted_exposed_optimizer_seconds(elements, on_host, forward_s, cpu_rate, during_backward=False)


def step_parts(config, m, chosen, gpu_s: float, forward_s: float, cpu_rate: float, copies_s: float) -> dict:
    """The step's parts (the module's note)."""
    elements, on_host = device_state_elements(m, chosen)
    host_elements = sum(n for n, h in zip(elements, on_host) if h)
    device_elements = sum(n for n, h, t in zip(elements, on_host, m.trainable) if t and not h)
    displaced = displaced_param_bytes(m, chosen)
    backward_s = gpu_s - forward_s
    tail = 0.0 if m.optimizer_steps_during_backward else max(
        0.0, host_elements * m.compute_itemsize / target.H2D_BYTES_PER_S - backward_s)
    per_element = DEVICE_OPTIMIZER_BYTES_PER_ELEMENT[(config.optimizer_state_dtype, bool(config.master_weights))]
    return {"gpu": gpu_s, "device_optimizer": device_elements * per_element / target.DEVICE_OPTIMIZER_BYTES_PER_S,
            "gradients_tail": tail, "optimizer_wait": optimizer_wait(m, chosen, backward_s, forward_s, cpu_rate),
            "fetch_stall": displaced / target.H2D_BYTES_PER_S, "activation_copies": copies_s}


def memory(m, chosen, host_chunk_bytes: int, activation_bytes: int, offloaded_host_bytes: int) -> dict:
    """The plan's device and host bytes (`host_chunk_bytes`: the chunks', host_fit.plan_host_bytes), and
    whether each fits."""
    budget = chosen.device_budget_bytes or m.device_capacity_bytes
    device = min(chunk_bytes(m, chosen, on_device_only=True), budget) + \
        int(activation_bytes * target.ACTIVATION_RESERVE_RATIO) + target.DEVICE_OTHER_BYTES
    host = host_chunk_bytes + offloaded_host_bytes
    return {"device_bytes": device, "host_bytes": host,
            "fits": {"device": device <= m.device_capacity_bytes, "device_capacity_bytes": m.device_capacity_bytes,
                     "device_total_bytes": m.device_total_bytes,
                     "host": None if m.host_available_bytes is None else host <= m.host_available_bytes,
                     "host_available_bytes": m.host_available_bytes}}


def lanes(m, chosen, parts: dict, cpu_rate: float) -> dict:
    """Each lane's predicted busy seconds in a step, as engine.stats()["lanes"] measures them
    (_engine/lanes.py), and the lane that bounds the step: the GPU's passes, each copy direction
    (the host sets' parameters up and gradients down, the displaced chunks' fetches), the CPU's and
    the link lane's host steps (where both step, each at its share of its rate while both run, as
    optimizer_wait schedules them), the device-held sets' steps."""
    elements, on_host = device_state_elements(m, chosen)
    link_sets = set(chosen.link_sets)
    link = sum(n for i, (n, h) in enumerate(zip(elements, on_host)) if h and i in link_sets)
    host = sum(n for n, h in zip(elements, on_host) if h)
    up = host * m.compute_itemsize + displaced_param_bytes(m, chosen)
    shares = RATE_SHARES_WHILE_BOTH_RUN if link else (1.0, 1.0)
    busy = {"gpu": parts["gpu"], "h2d": up / target.H2D_BYTES_PER_S,
            "d2h": host * m.compute_itemsize / target.H2D_BYTES_PER_S, "cpu": (host - link) / (cpu_rate * shares[0]),
            "link": link / (target.LINK_ELEMENTS_PER_S * shares[1]), "device_optimizer": parts["device_optimizer"]}
    return {"busy_seconds": busy, "bound": max(busy, key=busy.get)}
