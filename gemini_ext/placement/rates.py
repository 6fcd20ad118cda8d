"""Measured rates a placement decides from: how fast the host's CPU optimizer kernel steps
elements, and how fast chunks copy from the host to the compute device.

Each is measured once per process (and device) with a short probe, then kept: a policy that reads
rates has them probed when enable() plans the placement, before any optimizer step runs beside the
probe (on an H100's host a probe taken at the first decision, with the optimizer's host steps
running in the backward, read 2.4-2.9G elements/s, where the kernel stepped 5.0G in the training
step). The CPU probe is a CPU Adam step with a bf16 parameter copy (the kernel the host's optimizer
pipeline runs, at the same thread count) over enough elements that its arrays outgrow the last-level
cache several times (cpu_probe_elements): the optimizer's state never fits in it. A probe of 4M
elements (64 MiB of arrays) read 10.6-11.8G elements/s on that host, twice the kernel's rate over
the real state. The copy probe is a pinned host-to-device copy of PROBE_COPY_BYTES timed with CUDA
events (on sim, where a "device" copy is a host memcpy, a host copy of the same size). The best of a
few repetitions counts: the first touches the pages.

The link lane's rate (link_optimizer_elements_per_s) is the device's Adam kernel over
PROBE_ELEMENTS of pinned host state through mapped views (cuda only; 0 elsewhere), timed with
CUDA events.

Adam's kernel stands for every rule: SGD, Lion and Adagrad move fewer bytes per element, so for
them the rate is a lower bound and the plan errs toward moving more state to the device.
"""

from __future__ import annotations

import os
import time

import torch

from .._native import _C

PROBE_ELEMENTS = 1 << 22      # 4M elements: 16 MiB per fp32 tensor (the link lane's probe; the CPU's least)
CPU_PROBE_MAX_ELEMENTS = 1 << 26
CPU_PROBE_BYTES_PER_ELEMENT = 16  # fp32 master, m and v; bf16 gradient and parameter copy
CPU_PROBE_CACHE_MULTIPLE = 4      # the probe's arrays over the last-level cache
PROBE_COPY_BYTES = 32 << 20
REPEATS = 3

_cache: dict = {}


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The largest CPU cache's size in bytes (Linux sysfs), or 0 where it cannot be read."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    largest = 0
    try:
        entries = [e for e in os.listdir(root) if e.startswith("index")]
    except OSError:
        return 0
    for entry in entries:
        try:
            with open(os.path.join(root, entry, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = units.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in units else text
        if digits.isdigit():
            largest = max(largest, int(digits) * scale)
    return largest


def cpu_probe_elements(cache_bytes: int) -> int:
    """Elements of the CPU probe: its arrays CPU_PROBE_CACHE_MULTIPLE times the last-level cache,
    between PROBE_ELEMENTS and CPU_PROBE_MAX_ELEMENTS."""
    wanted = CPU_PROBE_CACHE_MULTIPLE * cache_bytes // CPU_PROBE_BYTES_PER_ELEMENT
    return int(min(CPU_PROBE_MAX_ELEMENTS, max(PROBE_ELEMENTS, wanted)))


def cpu_optimizer_elements_per_s() -> float:
    """Elements per second the CPU Adam kernel steps (master, m, v, gradient, bf16 copy)."""
    if "cpu" not in _cache:
        n = cpu_probe_elements(last_level_cache_bytes())
        master, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
        grad = torch.full((n,), 1e-3, dtype=torch.bfloat16)
        copy = torch.empty(n, dtype=torch.bfloat16)
        best = float("inf")
        for step in range(1, REPEATS + 1):
            started = time.perf_counter()
            _C.cpu_adam_step(master, m, v, grad, param16=copy, step=step, lr=1e-3, beta1=0.9, beta2=0.999,
                             eps=1e-8, weight_decay=0.0)
            best = min(best, time.perf_counter() - started)
        _cache["cpu"] = n / max(best, 1e-9)
    return _cache["cpu"]


def h2d_bytes_per_s(device) -> float:
    """Bytes per second of a pinned host-to-device copy onto `device` (a ComputeDevice)."""
    key = ("h2d", str(device.torch_device))
    if key not in _cache:
        if device.is_cuda:
            source = torch.empty(PROBE_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
            target = torch.empty(PROBE_COPY_BYTES, dtype=torch.uint8, device=device.torch_device)
            stream = torch.cuda.Stream(device.torch_device)
            best = float("inf")
            with torch.cuda.stream(stream):
                for _ in range(REPEATS):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    target.copy_(source, non_blocking=True)
                    end.record(stream)
                    end.synchronize()
                    best = min(best, start.elapsed_time(end) / 1e3)
            del source, target
        else:  # sim: a chunk "copy" is a host memcpy
            source = torch.ones(PROBE_COPY_BYTES, dtype=torch.uint8)
            target = torch.empty_like(source)
            best = float("inf")
            for _ in range(REPEATS):
                started = time.perf_counter()
                target.copy_(source)
                best = min(best, time.perf_counter() - started)
        _cache[key] = PROBE_COPY_BYTES / max(best, 1e-9)
    return _cache[key]


def link_optimizer_elements_per_s(device) -> float:
    """Elements per second the device's Adam kernel steps in pinned host memory over the link
    (the optimizer's link lane); 0.0 on a device without one (sim)."""
    if not device.is_cuda:
        return 0.0
    key = ("link", str(device.torch_device))
    if key not in _cache:
        n = PROBE_ELEMENTS
        host = [torch.zeros(n, pin_memory=True) for _ in range(3)]
        host += [torch.full((n,), 1e-3, dtype=torch.bfloat16, pin_memory=True),
                 torch.empty(n, dtype=torch.bfloat16, pin_memory=True)]
        master, m, v, grad, copy = (_C.mapped_device_view(t, device.torch_device) for t in host)
        stream = torch.cuda.Stream(device.torch_device)
        best = float("inf")
        with torch.cuda.stream(stream):
            for step in range(1, REPEATS + 1):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                _C.device_adam_step(master, m, v, grad, copy, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                    weight_decay=0.0, max_blocks=_C.LINK_LANE_BLOCKS)
                end.record(stream)
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1e3)
        del master, m, v, grad, copy, host
        _cache[key] = n / max(best, 1e-9)
    return _cache[key]
