"""Host-memory probes: what /proc says about this host and this process (Linux).

Each returns None where the figure cannot be read (another OS, a sandbox without /proc); callers
treat None as "unknown" and do not plan from it.
"""

from __future__ import annotations

import os


def _proc_field_bytes(path: str, key: str) -> int | None:
    """A "Key:  N kB" line of a /proc file in bytes; None where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def mem_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes."""
    return _proc_field_bytes("/proc/meminfo", "MemAvailable:")


def process_rss_bytes() -> int | None:
    """VmRSS of /proc/self/status in bytes: this process's resident memory, chunks and everything
    else."""
    return _proc_field_bytes("/proc/self/status", "VmRSS:")


def host_available_bytes() -> int | None:
    """Host memory this process may still fill: MemAvailable over the ranks of this node
    (LOCAL_WORLD_SIZE)."""
    available = mem_available_bytes()
    if available is None:
        return None
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
