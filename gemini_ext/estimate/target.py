"""The target machine as gx.estimate models it: the rates it cannot measure here (the GPU's, the
link's, the device optimizer's), each a constant fitted on a row of docs/BENCHMARKS.md named beside
it; the device's bytes and peak from arguments or the GPU present (no allocation); and the one rate
it measures here, the CPU Adam kernel's.
"""

from __future__ import annotations

import bisect
import time

import torch

from .._engine.throughput import PEAK_16BIT_TFLOPS
from .._native import _C
from .._units import parse_bytes

# Each fitted on docs/BENCHMARKS.md, "Large models at full speed, with the step-time estimate (2026-12-04, H200)"
# unless it says otherwise.
# (tokens per step, fraction of the dense 16-bit peak): the GPT's forward and backward FLOPs over their measured
# time at 1024-token sequences, interpolated
GPU_EFFICIENCY = ((1024, 0.58), (4096, 0.65), (8192, 0.665), (16384, 0.672))
H2D_BYTES_PER_S = 55e9  # pinned copies over PCIe 5 x16, either direction
LINK_ELEMENTS_PER_S = 2.8e9  # the device's Adam kernel over mapped host state (bench/link_adam.py)
HOST_DISPATCH_S_PER_TENSOR_PASS = 1.45e-4  # the host's share of a pass per parameter tensor: the 6.7B GPT's 1 x 1024
DEVICE_OPTIMIZER_BYTES_PER_S = 3.5e12  # the device Adam kernel's HBM traffic rate (H200: 4.8 TB/s peak)
ATTENTION_BASE_SEQ = 1024  # GPU_EFFICIENCY's sequences: their attention-score work is inside it
ATTENTION_BACKWARD_PER_FORWARD = 2.5  # a fused attention kernel's backward: scores recomputed, four products
# docs/BENCHMARKS.md, "The map: LLaMA-7B from 8k to 64k tokens per step, 24 GiB to the whole H100": torch's
# reserved over its allocated peak at an iteration's end, and what the device holds outside torch and the chunks
ACTIVATION_RESERVE_RATIO = 1.22
DEVICE_OTHER_BYTES = 1536 << 20
PROBE_ELEMENTS = 1 << 26  # the CPU Adam probe's elements (host memory only)


def gpu_efficiency(tokens: int) -> float:
    """GPU_EFFICIENCY at `tokens` tokens per step, interpolated, constant beyond its ends."""
    keys = [t for t, _ in GPU_EFFICIENCY]
    i = bisect.bisect_left(keys, tokens)
    if i == 0:
        return GPU_EFFICIENCY[0][1]
    if i == len(keys):
        return GPU_EFFICIENCY[-1][1]
    (t0, e0), (t1, e1) = GPU_EFFICIENCY[i - 1], GPU_EFFICIENCY[i]
    return e0 + (e1 - e0) * (tokens - t0) / (t1 - t0)


def cpu_elements_per_s() -> float:
    """The CPU Adam kernel over PROBE_ELEMENTS (host memory only), best of three."""
    n = PROBE_ELEMENTS
    master, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    grad = torch.full((n,), 1e-3, dtype=torch.bfloat16)
    copy = torch.empty(n, dtype=torch.bfloat16)
    best = float("inf")
    for step in range(1, 4):
        started = time.perf_counter()
        _C.cpu_adam_step(master, m, v, grad, param16=copy, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.0)
        best = min(best, time.perf_counter() - started)
    return n / best


def cpu_rate(given: float | None) -> tuple[float, str]:
    """The CPU Adam rate (elements/s) the estimate uses, and where it comes from."""
    return (float(given), "given") if given else (cpu_elements_per_s(), "measured here")


def device_figures(gpu_memory_limit, device_bytes, peak_tflops, device_name) -> tuple[int, int, float, str | None]:
    """(device bytes planned for, the whole device's bytes, peak TFLOP/s, name) without touching device
    memory: from the arguments, or the GPU present."""
    name = device_name
    if device_bytes is None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())  # no allocation
        device_bytes, name = props.total_memory, name or props.name
    if device_bytes is None:
        raise ValueError("gx.estimate: no GPU here to read the device memory from; pass device_bytes= (e.g. "
                         "'141GB') and peak_tflops= (or device_name=, e.g. 'H200') of the machine to estimate.")
    total = parse_bytes(int(device_bytes) if isinstance(device_bytes, float) else device_bytes,
                        "gx.estimate(device_bytes=...)")
    capacity = min(total, int(gpu_memory_limit)) if gpu_memory_limit else total
    if peak_tflops is None and name is not None:
        peak_tflops = next((t for key, t in PEAK_16BIT_TFLOPS if key in name), None)
    if peak_tflops is None:
        known = ", ".join(repr(key) for key, _ in PEAK_16BIT_TFLOPS)
        which = "no device_name= was given" if name is None else f"device {name!r} is not in the table"
        raise ValueError(f"gx.estimate: the device's 16-bit peak is needed for the step time, and {which}; pass "
                         f"device_name= (one of {known}) or peak_tflops= (its dense 16-bit TFLOP/s).")
    return capacity, total, float(peak_tflops), name
