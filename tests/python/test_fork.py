"""Host memory the engine owns is not inherited by forked children (SPEC §5).

A DataLoader's workers are forked; pages the child shares copy-on-write are copied as soon as
the parent writes them, and the engine rewrites its host memory at every step. Measured here as
the whole process group's proportional set size (the parent and its workers, shared pages
counted once): it must stay flat while the engine trains with two persistent workers. Measured in
a fresh interpreter (workers/fork_worker.py): the parent's own heap is shared copy-on-write with the workers
as in any program, and what earlier tests left in it would be counted too."""

import json
import os

import pytest

from conftest import DEVICES, run_python


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/smaps_rollup"), reason="needs Linux's /proc smaps_rollup")
@pytest.mark.parametrize("device", DEVICES)
def test_dataloader_workers_leave_host_memory_flat(device):
    out = run_python("tests/python/workers/fork_worker.py", device, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["workers"] == 2, r
    assert r["engine_host_bytes"] > 2**29, r  # the model is large enough to see a copy
    # The engine's own new memory is not the workers': speculative spares it took meanwhile are left out.
    growth = r["growth"] - r["spares_growth"]
    assert growth < 0.05 * r["engine_host_bytes"], (
        f"host memory of this process and its 2 DataLoader workers grew by {growth / 2**20:.1f} MiB over 4 steps "
        f"({growth / r['engine_host_bytes']:.1%} of the engine's {r['engine_host_bytes'] / 2**20:.0f} MiB of host "
        "memory): pages the workers inherited were copied as the engine rewrote them")
