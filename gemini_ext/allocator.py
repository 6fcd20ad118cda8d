"""The allocator mode (GEMINI_EXT_ALLOCATOR, docs/USAGE.md) and its statistics.

- `default`: chunk slots come from our chunk pools (a reserved arena per tier, fixed-size
  slots reused after the events of their last uses); everything else stays on PyTorch's CUDA
  caching allocator, whose statistics feed the auto policy.
- `chunk`: at `import gemini_ext`, before CUDA initialises, our allocator replaces PyTorch's for
  the whole process through the pluggable-allocator interface (csrc/cuda/process_allocator.*,
  installed by csrc/torch/allocator_mode.*). Torch's allocations come from a stream-ordered
  caching arena of ours; one that would fail first asks the engines to evict chunks that no
  module computes on, then retries. `torch.cuda.memory_stats()` does not work under a pluggable
  allocator: `gx.memory_stats()` has exact figures of its own in both modes.
"""

from __future__ import annotations

import os

import torch

from ._native import _C
from ._env import SETTINGS


def mode() -> str:
    """The active mode: 'chunk' only once our allocator is installed."""
    return "chunk" if _C.chunk_allocator_installed() else "default"


def install_if_requested() -> None:
    """Called once by `import gemini_ext`: installs the chunk allocator when GEMINI_EXT_ALLOCATOR=chunk,
    or raises RuntimeError saying what stands in the way and how to fix it."""
    if SETTINGS.allocator != "chunk" or _C.chunk_allocator_installed():
        return
    why = None
    if not _C.build_info()["cuda"]:
        why = ("this build of gemini_ext is CPU-only, so there is no CUDA allocator to replace. Unset "
               "GEMINI_EXT_ALLOCATOR (or set it to 'default'), or install a CUDA build of gemini_ext")
    elif not torch.cuda.is_available():
        why = "no CUDA device is visible to torch. Unset GEMINI_EXT_ALLOCATOR on machines without a GPU"
    elif torch.cuda.is_initialized():
        why = ("CUDA was already initialised in this process, so torch's caching allocator is in use and cannot be "
               "replaced. Import gemini_ext before anything touches CUDA (before creating CUDA tensors, "
               "calling torch.cuda.* functions that initialise it, or importing libraries that do)")
    elif SETTINGS.device == "sim":
        why = ("GEMINI_EXT_DEVICE=sim computes on the host and never uses the CUDA allocator it would replace. "
               "Use GEMINI_EXT_DEVICE=cuda (or auto) with the chunk allocator, or unset GEMINI_EXT_ALLOCATOR")
    elif os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").strip():
        why = (f"PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']!r} configures the caching allocator "
               "that the chunk allocator replaces, so its settings would be ignored. Unset PYTORCH_CUDA_ALLOC_CONF, "
               "or use GEMINI_EXT_ALLOCATOR=default")
    if why is not None:
        raise RuntimeError(f"GEMINI_EXT_ALLOCATOR=chunk: {why}.")
    _C.install_chunk_allocator()


def _stat(current: int = 0, peak: int = 0, allocated: int = 0, freed: int = 0) -> dict:
    return {"current": current, "peak": peak, "allocated": allocated, "freed": freed}


def memory_stats() -> dict:
    """Exact device-memory figures of this process, in bytes (all devices together):

    - mode: 'default' or 'chunk'
    - allocated_bytes {current, peak, allocated, freed}: torch's allocations (activations,
      temporaries, optimizer buffers): our arena under 'chunk', torch's caching allocator under
      'default' (zeros before CUDA is initialised)
    - reserved_bytes {current, peak}: what that allocator holds from the device, cached or not
    - chunk_slot_bytes: device memory of chunk slots (our chunk pools, both modes)
    - chunk mode only: allocations, frees, ooms_rescued (allocations that succeeded after a
      device sync or chunk eviction), ooms_failed, reclaimed_bytes (released by evicting
      chunks), record_streams
    """
    out = {"mode": mode(), "chunk_slot_bytes": chunk_slot_bytes()}
    if out["mode"] == "chunk":
        s = _C.chunk_allocator_stats()
        out["allocated_bytes"] = _stat(s["allocated_bytes.current"], s["allocated_bytes.peak"],
                                       s["allocated_bytes.allocated"], s["allocated_bytes.freed"])
        out["reserved_bytes"] = {"current": s["reserved_bytes.current"], "peak": s["reserved_bytes.peak"]}
        for key in ("allocations", "frees", "ooms_rescued", "ooms_failed", "reclaimed_bytes", "record_streams"):
            out[key] = s[key]
        return out
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        t = {"allocated": _stat(), "reserved": _stat()}
        for d in range(torch.cuda.device_count()):
            s = torch.cuda.memory_stats(d)
            for kind in t:
                for field in ("current", "peak", "allocated", "freed"):
                    t[kind][field] += s.get(f"{kind}_bytes.all.{field}", 0)
        out["allocated_bytes"] = t["allocated"]
        out["reserved_bytes"] = {"current": t["reserved"]["current"], "peak": t["reserved"]["peak"]}
    else:
        out["allocated_bytes"] = _stat()
        out["reserved_bytes"] = {"current": 0, "peak": 0}
    return out


def reset_peak_memory_stats(device=None) -> None:
    """Resets the peaks of memory_stats() (and torch's, in default mode, on `device` or all)."""
    if mode() == "chunk":
        _C.reset_chunk_allocator_peak()
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = [device] if device is not None else range(torch.cuda.device_count())
        for d in devices:
            torch.cuda.reset_peak_memory_stats(d)


def torch_allocated_bytes(device) -> int:
    """Bytes torch's allocations hold now on `device` (the arena's figure under 'chunk', where
    torch.cuda.memory_allocated() raises: a pluggable allocator has no device statistics)."""
    if mode() == "chunk":
        return int(_C.chunk_allocator_stats()["allocated_bytes.current"])
    return int(torch.cuda.memory_allocated(device))


def chunk_slot_bytes() -> int:
    """Device memory of chunk slots (the chunk pools of every engine, all devices)."""
    return int(_C.chunk_slot_device_bytes())


def torch_reserved_bytes(device) -> int:
    """Bytes torch's allocator holds from `device` now, in use or cached (its segments, so its
    fragmentation included): our arena's reservation under 'chunk'."""
    if mode() == "chunk":
        return int(_C.chunk_allocator_stats()["reserved_bytes.current"])
    return int(torch.cuda.memory_reserved(device))


def process_device_bytes(device) -> int | None:
    """This process's memory on `device` as the driver counts it (NVML's per-process figure: torch's
    segments, the chunk pools, the CUDA context and the libraries' workspaces); None where the driver
    does not tell (no NVML, or a process namespace that shows the driver other process ids)."""
    try:
        import pynvml

        handle = torch.cuda._get_pynvml_handler(device)
        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # no NVML library or binding, or a driver that refuses the query
        return None
    pid = os.getpid()
    for p in processes:
        if p.pid == pid and isinstance(p.usedGpuMemory, int):
            return int(p.usedGpuMemory)
    return None


def outside_torch_bytes(device, whole_device: bool) -> int:
    """Device memory that neither torch's allocator nor a chunk pool holds: this process's CUDA
    context and library workspaces (NVML's per-process figure where the driver tells, else the whole
    device's use), and on the whole device what other processes hold too, since it is not there to
    take. Under a gpu_memory_limit it counts against the limit as much as torch and the chunks do."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    if not whole_device:
        own = process_device_bytes(device)
        used = own if own is not None else used
    return max(0, used - torch_reserved_bytes(device) - chunk_slot_bytes())


def begin_non_model_window(device) -> None:
    """Starts measuring the peak of torch's allocations (the non-model data) on `device` from
    now, without resetting any peak statistic: torch.cuda.max_memory_allocated() and
    memory_stats() keep their meaning for the user (csrc/torch/allocation_window.h)."""
    _C.allocation_window_begin(torch.device(device).index or 0)


def non_model_peak_bytes(device) -> int:
    """Peak bytes of torch's allocations on `device` since begin_non_model_window."""
    return int(_C.allocation_window_peak(torch.device(device).index or 0))


def empty_cache() -> int:
    """Gives cached, unused device memory back (torch.cuda.empty_cache() does the same in chunk
    mode); returns the bytes released in chunk mode, 0 in default mode."""
    if mode() == "chunk":
        return int(_C.chunk_allocator_empty_cache())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return 0
