"""MemoryTracer: per-iteration figures of model data against non-model data, chunk traffic and
waits, and the scheduling timeline (engine.stats()["steps"], engine.memory_timeline()).

Model data is the chunks: their bytes on the device after each scheduling event come from the
C++ manager's timeline (fetch 'F', prefetch 'P', evict 'E', iteration end 'S'). Non-model data is
everything torch's CUDA allocator holds besides (activations, temporaries), measured per
iteration in a window of our own so that torch's peak statistics stay the user's (on sim,
activations live in host memory: 0). `memory_figures()` says where memory stands, for logs and
out-of-memory errors. SetupTimer times enable()'s phases the same way (stats()["setup_seconds"]).
"""

from __future__ import annotations

import time

import torch

from .. import allocator
from .host_memory import cgroup_free_bytes, mem_available_bytes, process_rss_bytes
from .costs import HOST_TIERS, TIERS
from .._units import format_bytes

HISTORY = 10_000  # iterations kept


class MemoryTracer:
    def __init__(self, chunks, runtime, device):
        self._chunks = chunks
        self._runtime = runtime
        self._device = device  # ComputeDevice
        self.steps = []  # per iteration: traffic and scheduling deltas
        self._last_totals = None

    def begin(self) -> None:
        """Starts the first iteration's non-model window."""
        if self._device.is_cuda:
            allocator.begin_non_model_window(self._device.torch_device)

    def end_iteration(self, report: dict, pass_seconds: dict | None = None) -> None:
        """Records the iteration that just ended from the manager's report (GeminiManager.end_iteration:
        its counters and the iteration's peak chunk bytes on the device), with the host wall times of
        its last forward and backward passes (HookSet.last_pass_seconds)."""
        totals = self._totals(report["counters"])
        last = self._last_totals or {k: 0 for k in totals}
        entry = {k: totals[k] - last[k] for k in totals}
        entry["prefetch_misses"] = entry["sync_fetches"]  # a chunk compute needed that was not fetched ahead
        entry["device_bytes_peak"] = report["device_bytes_peak"]  # model data: chunk bytes on the device
        entry["host_bytes"] = sum(self._chunks.tier_bytes(t)["current"] for t in HOST_TIERS)
        entry.update(pass_seconds or {"forward_seconds": 0.0, "backward_seconds": 0.0})
        entry.update(self._device_figures())
        self.steps.append(entry)
        if len(self.steps) > HISTORY:
            del self.steps[:-HISTORY]
        self._last_totals = totals

    def _device_figures(self) -> dict:
        """The iteration's non-model figures on the device, and a new window for the next one:
        torch's allocation peak in the window, what its allocator holds from the device now (its
        cached segments keep the iteration's high-water mark, fragmentation included), and the
        device memory neither torch's allocator nor any chunk pool holds (allocator.outside_torch_bytes:
        the CUDA context, libraries allocating outside torch; other processes on the whole device). All
        0 on sim, where activations live on the host."""
        if not self._device.is_cuda:
            return {"non_model_peak_bytes": 0, "non_model_reserved_bytes": 0, "device_other_bytes": 0}
        device = self._device.torch_device
        peak = allocator.non_model_peak_bytes(device)
        allocator.begin_non_model_window(device)
        reserved = allocator.torch_reserved_bytes(device)
        whole = self._device.capacity_bytes() >= self._device.total_bytes()
        return {"non_model_peak_bytes": peak, "non_model_reserved_bytes": reserved,
                "device_other_bytes": allocator.outside_torch_bytes(device, whole_device=whole)}

    def last_device_figures(self) -> dict:
        """_device_figures() of the last iteration (zeros before the first ends)."""
        keys = ("non_model_peak_bytes", "non_model_reserved_bytes", "device_other_bytes")
        return {k: self.steps[-1][k] for k in keys} if self.steps else dict.fromkeys(keys, 0)

    def last_pass_seconds(self) -> dict:
        """The last iteration's forward and backward seconds (zeros before the first ends)."""
        keys = ("forward_seconds", "backward_seconds")
        return {k: self.steps[-1][k] for k in keys} if self.steps else dict.fromkeys(keys, 0.0)

    def last_optimizer_wait_seconds(self) -> float:
        """Host time the last iteration was blocked on host optimizer steps still running (0.0 before
        the first ends): with overlapped steps, the forward's wait for the step before it."""
        return self.steps[-1]["optimizer_wait_seconds"] if self.steps else 0.0

    def _totals(self, c: dict) -> dict:
        self._chunks.poll()  # collects the copy waits measured so far
        t = self._chunks.traffic()
        return {"h2d_bytes": t["h2d_bytes"], "d2h_bytes": t["d2h_bytes"], "evictions": c["evictions"],
                "prefetches": t["prefetches"], "prefetch_hits": t["prefetch_hits"],
                "prefetch_wasted": t["prefetch_wasted"], "sync_fetches": c["sync_fetch_waits"],
                "wait_seconds": c["wait_seconds"], "optimizer_wait_seconds": c["optimizer_wait_seconds"],
                "copy_wait_seconds": t["copy_wait_seconds"],
                "copy_waits": t["copy_waits"]}

    def timeline(self) -> dict:
        events = [{"t": t, "kind": kind, "chunk": chunk, "device_bytes": b}
                  for t, kind, chunk, b in self._runtime.timeline()]
        return {"events": events, "steps": list(self.steps), "device_budget_bytes": self._runtime.device_budget}

    def stats(self) -> dict:
        """engine.stats()'s figures of the chunks: layout, bytes per tier, traffic, counters."""
        chunks, runtime = self._chunks, self._runtime
        tiers = {t: chunks.tier_bytes(t) for t in TIERS}
        return {
            "num_chunks": chunks.num_chunks,
            "wasted_bytes_all_groups": chunks.wasted_bytes(),
            "tier_bytes": tiers,
            "peak_device_bytes": tiers["device"]["peak"],
            "host_bytes": sum(tiers[t]["current"] for t in HOST_TIERS),
            "traffic": chunks.traffic(),
            "counters": runtime.counters(),
            # the chunk pools: a reserved arena per tier, slots reused after their last uses
            "pools": {t: chunks.pool_stats(t) for t in tiers},
            "steps": list(self.steps[-100:]),
            "device_budget_bytes": runtime.device_budget,
            "trace": {k: v for k, v in runtime.trace_info().items() if k != "recorded"},
        }

    def memory_figures(self) -> str:
        """Where memory stands: chunks against everything else, on the device and on the host."""
        chunks = self._chunks
        host = chunks.host_tier
        pool = chunks.pool_stats(host)
        rss, available = process_rss_bytes(), mem_available_bytes()
        parts = [f"chunks on the device {format_bytes(chunks.tier_bytes('device')['current'])}",
                 f"chunks on the host ({host}) {format_bytes(pool['in_use_bytes']['current'])} in use, "
                 f"{format_bytes(pool['reserved_bytes']['current'])} reserved by the pool"]
        if rss is not None:
            parts.append(f"this process's resident memory {format_bytes(rss)}")
        if available is not None:
            parts.append(f"the host's MemAvailable {format_bytes(available)}")
        free_bytes = cgroup_free_bytes()
        if free_bytes is not None:
            parts.append(f"the cgroup's room {format_bytes(free_bytes[0])} ({free_bytes[1]} less its usage)")
        if self._device.is_cuda:
            device = self._device.torch_device
            free, total = torch.cuda.mem_get_info(device)
            parts.append(f"the device's free memory {format_bytes(free)} of {format_bytes(total)}, "
                         f"{format_bytes(allocator.torch_allocated_bytes(device))} allocated by torch")
        return "; ".join(parts)

    def detach(self) -> None:
        """The engine is closing: let go of the chunk manager and the runtime."""
        self._chunks = self._runtime = None


class SetupTimer:
    """Seconds per phase of enable(), for the log and stats(): where a large model's set-up goes."""

    def __init__(self):
        self.start = self._last = time.perf_counter()
        self.phases = {}

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self._last
        self._last = now

    def total(self) -> float:
        return time.perf_counter() - self.start
