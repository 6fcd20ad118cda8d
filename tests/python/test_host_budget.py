"""The host budget: the cgroup limits read as the kernel enforces them, and a plan over them
refused naming the limit."""

import os

import pytest

import gemini_ext as gx
from parity_utils import config, make_models
from placement_utils import param_chunk_bytes


def _cgroup_tree(root, proc_lines, files):
    root.mkdir(parents=True)
    proc = root / "proc_cgroup"
    proc.write_text("".join(line + "\n" for line in proc_lines))
    for rel, text in files.items():
        (root / "fs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "fs" / rel).write_text(text + "\n")
    return str(proc), str(root / "fs")


def test_the_host_budget_reads_the_cgroup_limits_as_the_kernel_enforces_them(tmp_path, monkeypatch):
    from gemini_ext.placement import host_memory
    GiB = 1 << 30
    # cgroup v2: the tightest of the cgroup and its ancestors, limit less usage ("max": none)
    proc, root = _cgroup_tree(tmp_path / "v2", ["0::/kubepods/pod1/c1"], {
        "kubepods/memory.max": str(64 * GiB), "kubepods/memory.current": str(60 * GiB),
        "kubepods/pod1/memory.max": str(16 * GiB), "kubepods/pod1/memory.current": str(2 * GiB),
        "kubepods/pod1/c1/memory.max": "max", "kubepods/pod1/c1/memory.current": str(1 * GiB)})
    room, source = host_memory.cgroup_free_bytes(proc, root)
    assert room == 4 * GiB and source.endswith("kubepods/memory.max"), (room, source)
    # cgroup v1: the memory controller's hierarchy; its "no limit" is a number near 2**63
    proc, root = _cgroup_tree(tmp_path / "v1", ["5:cpu,cpuacct:/job", "4:memory:/slurm/job7"], {
        "memory/slurm/memory.limit_in_bytes": str(2 ** 63 - 4096), "memory/slurm/memory.usage_in_bytes": "0",
        "memory/slurm/job7/memory.limit_in_bytes": str(8 * GiB),
        "memory/slurm/job7/memory.usage_in_bytes": str(3 * GiB)})
    assert host_memory.cgroup_free_bytes(proc, root) == (5 * GiB,
                                                   os.path.join(root, "memory/slurm/job7/memory.limit_in_bytes"))
    assert host_memory.cgroup_free_bytes(str(tmp_path / "absent"), root) is None
    # the budget: the least of MemAvailable and the cgroup's room, shared by the ranks on the host
    monkeypatch.setattr(host_memory, "mem_available_bytes", lambda: 100 * GiB)
    budget = host_memory.host_budget(2, proc, root)
    assert budget.bytes == 5 * GiB // 2 and "memory/slurm/job7/memory.limit_in_bytes" in budget.source, budget
    assert "shared by the 2 ranks" in budget.source
    monkeypatch.setattr(host_memory, "mem_available_bytes", lambda: 4 * GiB)
    assert host_memory.host_budget(1, proc, root).source.startswith("MemAvailable")


def test_enable_refuses_a_plan_over_the_cgroup_limit_naming_it(monkeypatch):
    """The auto policy plans the host with the cgroup's room, not the machine's MemAvailable,
    and refuses before taking any memory, naming the limit's file."""
    from gemini_ext.placement import host_memory, placer as _placement
    sizes = param_chunk_bytes("sim")
    room = sum(sizes) + sum(sizes) * 3 // 4  # a quarter of the optimizer state has no home
    monkeypatch.setattr(host_memory, "cgroup_free_bytes",
                        lambda *a, **k: (room + 64 * 1024, "/sys/fs/cgroup/job/memory.max"))
    monkeypatch.setattr(_placement.Placer, "_releasable_host_bytes", lambda self: 0)
    model, _ = make_models()
    with pytest.raises(gx.OutOfMemoryError, match="the cgroup limit /sys/fs/cgroup/job/memory.max"):
        gx.enable(model, config("sim", placement_policy="auto", sim_capacity=sum(sizes)))
