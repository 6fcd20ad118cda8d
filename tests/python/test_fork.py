"""Host memory the engine owns is not inherited by forked children (SPEC §5).

A DataLoader's workers are forked; pages the child shares copy-on-write are copied as soon as
the parent writes them, and the engine rewrites its host memory at every step. Measured here as
the workers' proportional set size: a page the parent copies leaves the workers sharing the old
one, so their Pss grows by a third of each page copied (two workers); the parent's first touch of
memory it reserved earlier is its own and is not counted. It must stay flat while the engine
trains with two persistent workers. Measured in a fresh interpreter (workers/fork_worker.py): the parent's own heap is
shared copy-on-write with the workers
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
    copied = 3 * r["workers_pss_growth"]  # each page copied adds a third of it to two workers' Pss
    assert copied < 0.05 * r["engine_host_bytes"], (
        f"the 2 DataLoader workers' Pss grew by {r['workers_pss_growth'] / 2**20:.1f} MiB over 4 steps: about "
        f"{copied / 2**20:.0f} MiB ({copied / r['engine_host_bytes']:.1%} of the engine's "
        f"{r['engine_host_bytes'] / 2**20:.0f} MiB of host memory) that the workers inherited was copied as the "
        "parent rewrote it")
