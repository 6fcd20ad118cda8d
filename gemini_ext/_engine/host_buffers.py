"""HostBuffers: host memory for what the engine keeps off the device outside chunks (offloaded
activations), taken from the device backend's host resource and reused from step to step.

[Note: where the bytes come from]
- `DeviceContext.host_buffer` (csrc/torch/host_buffer.h): the resource the host tier's chunks use,
  page-locked on cuda (copies to and from the device run asynchronously) and never shared with a
  forked child (DataLoader workers copy nothing when the engine rewrites it).
- Every step offloads tensors of the same sizes, so a released buffer waits in a free list keyed
  by its size and the next request of that size takes it: after the first step nothing is
  allocated.
- Host room (SPEC §5: the kernel's out-of-memory killer must never be what stops a run): a new
  buffer is taken only while the host keeps `reserve_bytes` free beyond it (the least of
  MemAvailable and the cgroup's room, shared by this host's ranks); otherwise, or when the resource
  refuses, `acquire` returns None and the caller keeps the tensor where it is.
"""

from __future__ import annotations

import collections

import torch

from ..placement.host_memory import host_available_bytes

RESERVE_BYTES = 4 * 2**30  # what the host keeps free beyond the buffers (the process's own growth, the OS)


class HostBuffers:
    """Byte buffers by size; `acquire` a buffer, `release` it when its contents are no longer needed."""

    def __init__(self, context, ranks_on_host: int = 1, reserve_bytes: int = RESERVE_BYTES):
        self._context = context
        self._ranks_on_host = ranks_on_host
        self._reserve_bytes = reserve_bytes
        self._free: dict[int, list] = collections.defaultdict(list)
        self.reserved_bytes = 0     # every buffer taken from the resource, in use or free
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.refused = 0            # requests left unserved (no host room)

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 CPU tensor of `nbytes`, or None when the host has no room for a new one."""
        free = self._free.get(nbytes)
        if free:
            buf = free.pop()
        else:
            buf = self._allocate(nbytes)
            if buf is None:
                self.refused += 1
                return None
            self.reserved_bytes += nbytes
        self.in_use_bytes += nbytes
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        nbytes = buf.numel()
        self.in_use_bytes -= nbytes
        self._free[nbytes].append(buf)

    def _allocate(self, nbytes: int) -> torch.Tensor | None:
        room = host_available_bytes(self._ranks_on_host)
        if room is not None and nbytes + self._reserve_bytes > room:
            return None
        try:
            return self._context.host_buffer(nbytes)
        except (MemoryError, RuntimeError):  # the resource refused (OutOfMemoryError derives from RuntimeError)
            return None

    def room_bytes(self) -> int:
        """What offloaded tensors may take at once: the buffers held, and what the host can give
        beyond them while keeping its reserve (no limit where the host's room is unknown: -1)."""
        room = host_available_bytes(self._ranks_on_host)
        if room is None:
            return -1
        return self.reserved_bytes + max(0, room - self._reserve_bytes)

    def trim(self) -> None:
        """Gives every free buffer back to the resource."""
        for size, bufs in self._free.items():
            self.reserved_bytes -= size * len(bufs)
        self._free.clear()

    def stats(self) -> dict:
        return {"reserved_bytes": self.reserved_bytes, "in_use_bytes": self.in_use_bytes,
                "peak_in_use_bytes": self.peak_in_use_bytes, "refused": self.refused}
