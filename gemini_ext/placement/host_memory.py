"""Host-memory probes: what /proc and the cgroup filesystem say about this host and this
process (Linux).

[Note: the host budget is what the kernel enforces]
MemAvailable is the machine's; a container (Kubernetes, SLURM, Docker) is killed at its cgroup's
limit, which can be far below it. The host budget is therefore the least of MemAvailable and,
for every cgroup from this process's up to the root, its limit less its current usage (cgroup v2:
`memory.max` and `memory.current`; v1: `memory.limit_in_bytes` and `memory.usage_in_bytes` of the
memory controller), shared by the ranks of this host, counted from the process group (ranks whose
hostnames match: _engine/process_groups.py) rather than from an environment variable that not
every launcher sets. Each probe returns None where the figure cannot be read (another OS, a
sandbox without /proc); callers treat None as "unknown" and do not plan from it.
"""

from __future__ import annotations

import dataclasses
import os

from .._units import format_bytes

UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


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


def mem_total_bytes() -> int | None:
    """MemTotal of /proc/meminfo in bytes."""
    return _proc_field_bytes("/proc/meminfo", "MemTotal:")


def process_rss_bytes() -> int | None:
    """VmRSS of /proc/self/status in bytes: this process's resident memory, chunks and everything
    else."""
    return _proc_field_bytes("/proc/self/status", "VmRSS:")


def _read_int(path: str) -> int | None:
    """A cgroup file holding one number, or None ("max", unreadable, or absent)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    try:
        value = int(text)
    except ValueError:
        return None  # "max": no limit
    return value if value < UNLIMITED else None


def cgroup_free_bytes(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """The least room (limit less usage) of this process's memory cgroup and its ancestors, with
    the limit file it comes from; None without a limit (or without cgroups)."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    hierarchies = []  # (this cgroup's directory, the hierarchy's root, limit file, usage file)
    for hierarchy, controllers, rel in lines:
        if hierarchy == "0" and controllers == "":  # v2, the unified hierarchy
            hierarchies.append((root, rel, "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):  # v1, the memory controller's own hierarchy
            hierarchies.append((os.path.join(root, "memory"), rel, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    best = None
    for top, rel, limit_name, usage_name in hierarchies:
        top = os.path.normpath(top)
        d = os.path.normpath(os.path.join(top, rel.lstrip("/")))
        while d.startswith(top):
            limit = _read_int(os.path.join(d, limit_name))
            if limit is not None:
                free_bytes = max(0, limit - (_read_int(os.path.join(d, usage_name)) or 0))
                if best is None or free_bytes < best[0]:
                    best = (free_bytes, os.path.join(d, limit_name))
            if d == top:
                break
            d = os.path.dirname(d)
    return best


@dataclasses.dataclass(frozen=True)
class HostBudget:
    bytes: int          # what this rank may still fill
    source: str         # which limit it comes from, in words (for messages)


def host_budget(ranks_on_host: int = 1, proc_cgroup: str = "/proc/self/cgroup",
                cgroup_root: str = "/sys/fs/cgroup") -> HostBudget | None:
    # see [Note: the host budget is what the kernel enforces]
    """Host memory this rank may still fill (see the note above): the least of MemAvailable and
    the cgroup limits less their usage, over the ranks of this host. None when neither is readable."""
    ranks = max(1, int(ranks_on_host))
    options = []
    available = mem_available_bytes()
    if available is not None:
        options.append((available, "MemAvailable of /proc/meminfo"))
    free_bytes = cgroup_free_bytes(proc_cgroup, cgroup_root)
    if free_bytes is not None:
        options.append((free_bytes[0], f"the cgroup limit {free_bytes[1]} less the cgroup's usage"))
    if not options:
        return None
    total, source = min(options)
    share = f", shared by the {ranks} ranks on this host" if ranks > 1 else ""
    return HostBudget(total // ranks, f"{source}: {format_bytes(total)}{share}")


def host_available_bytes(ranks_on_host: int = 1) -> int | None:
    """host_budget()'s bytes, or None."""
    budget = host_budget(ranks_on_host)
    return None if budget is None else budget.bytes
