"""HostBuffers: host memory for offloaded activations, from the C++ pool (`_C.HostBufferPool`,
csrc/torch/host_buffer_pool.h over core/size_class_pool.h) with the host's room checked first.

[Note: where the bytes come from]
- The pool takes its memory from the resource the host tier's chunks use: page-locked on cuda
  (copies to and from the device run asynchronously) and never shared with a forked child.
- Every step offloads tensors of the same sizes: a buffer freed returns to its size class and the
  next request of that class takes it, after the first step nothing is allocated. A buffer is
  reused by event: it is handed out with the streams that copy into and out of it, the first of
  them waits for the buffer's previous copies, and freeing the tensor records the events its next
  use waits for. The host never waits for a copy to reuse a buffer.
- Host room (SPEC §5: the kernel's out-of-memory killer must never be what stops a run): a buffer
  beyond those the pool holds is taken only while the host keeps `reserve_bytes` free beyond it
  (the least of MemAvailable and the cgroup's room, shared by this host's ranks); otherwise, or
  when the resource refuses, `acquire` returns None and the caller keeps the tensor where it is.
"""

from __future__ import annotations

import torch

from ..._native import _C
from ...placement.host_memory import host_available_bytes

RESERVE_BYTES = 4 * 2**30  # what the host keeps free beyond the buffers (the process's own growth, the OS)


class HostBuffers:
    """`acquire` a byte buffer; it goes back to the pool when the tensor is freed."""

    def __init__(self, context, ranks_on_host: int = 1, reserve_bytes: int = RESERVE_BYTES):
        self._pool = _C.HostBufferPool(context)
        self._ranks_on_host = ranks_on_host
        self._reserve_bytes = reserve_bytes
        self.refused = 0  # requests left unserved (no host room)

    def acquire(self, nbytes: int, streams: list[int]) -> torch.Tensor | None:
        """A uint8 CPU tensor of `nbytes` used by `streams` (raw CUDA streams, the one that writes it
        first; [] on sim), or None when the host has no room for it."""
        if not self._pool.has_free_slot(nbytes):
            free_bytes = host_available_bytes(self._ranks_on_host)
            if free_bytes is not None and nbytes + self._reserve_bytes > free_bytes:
                self.refused += 1
                return None
        try:
            return self._pool.buffer(nbytes, streams)
        except (MemoryError, RuntimeError):  # the resource refused (OutOfMemoryError derives from RuntimeError)
            self.refused += 1
            return None

    def free_bytes(self) -> int:
        """What offloaded tensors may take at once: the buffers held, and what the host can give
        beyond them while keeping its reserve (no limit where the host's room is unknown: -1)."""
        free_bytes = host_available_bytes(self._ranks_on_host)
        if free_bytes is None:
            return -1
        return self._pool.stats()["reserved_bytes"] + max(0, free_bytes - self._reserve_bytes)

    def trim(self) -> None:
        """Gives every free buffer back to the resource (after its copies)."""
        self._pool.release_free()

    def stats(self) -> dict:
        return {**self._pool.stats(), "refused": self.refused}
