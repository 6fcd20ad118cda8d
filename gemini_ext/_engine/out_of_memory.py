"""What an out-of-memory error that leaves the engine's `with` block is told: the memory figures
when it ran out, and, for torch's allocator under GEMINI_EXT_ALLOCATOR=default, why the chunks
did not make room and which knob would."""

from __future__ import annotations

import torch

from .. import allocator
from .._units import format_bytes


def out_of_memory_notes(exc: BaseException, parts, config) -> list[str]:
    notes = []
    if isinstance(exc, torch.OutOfMemoryError) and parts.device.is_cuda and allocator.mode() == "default":
        notes.append(f"gemini_ext: torch's allocator ran out of device memory with "
                     f"{format_bytes(parts.chunks.tier_bytes('device')['current'])} of chunks on the device "
                     f"(placement_policy={config.placement_policy!r}). Under GEMINI_EXT_ALLOCATOR=default chunks are "
                     "not evicted for torch's allocations: set GEMINI_EXT_ALLOCATOR=chunk (before importing "
                     "gemini_ext) so that chunks go to the host on demand, or lower gpu_memory_limit / "
                     "const_gpu_budget, the batch size, or use activation checkpointing.")
    notes.append(f"gemini_ext: memory when it ran out: {parts.tracer.memory_figures()}.")
    return notes
