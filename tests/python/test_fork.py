"""Host memory the engine owns is not inherited by forked children (SPEC §5).

A DataLoader's workers are forked; pages the child shares copy-on-write are copied as soon as
the parent writes them, and the engine rewrites its host memory at every step. Measured here as
the whole process group's proportional set size (the parent and its workers, shared pages
counted once): it must stay flat while the engine trains with two persistent workers."""

import os

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES

WIDTH, LAYERS = 4096, 4  # 67M parameters: about 1 GiB of host state (fp32 masters, m, v, gradients)


def _pss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no Pss line in /proc/{pid}/smaps_rollup")


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _group_pss_bytes(workers: set) -> int:
    """Pss of this process and of `workers` (its children that are alive)."""
    alive = workers & set(_children(os.getpid()))
    assert alive == workers, f"workers {sorted(workers - alive)} ended"
    return _pss_bytes(os.getpid()) + sum(_pss_bytes(k) for k in workers)


class _Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((WIDTH,), float(i % 7) / 7)


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/smaps_rollup"), reason="needs Linux's /proc smaps_rollup")
@pytest.mark.parametrize("device", DEVICES)
def test_dataloader_workers_leave_host_memory_flat(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    dtype = torch.float32 if device == "sim" else torch.bfloat16
    cfg = gx.GeminiConfig(device=device, precision="fp32" if device == "sim" else "bf16",
                          chunk_config_dict={"chunk_size": WIDTH * WIDTH + WIDTH},
                          **({"sim_capacity": "2GiB"} if device == "sim" else {}))
    loader = torch.utils.data.DataLoader(_Rows(), batch_size=4, num_workers=2, persistent_workers=True,
                                         multiprocessing_context="fork")
    compute = torch.device("cuda" if device == "cuda" else "cpu")
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        others = set(_children(os.getpid()))  # children of earlier tests in this process, if any
        batches = iter(loader)

        def step():
            x = next(batches).to(compute, dtype)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            engine.synchronize()

        step()  # the workers start; the optimizer state exists
        workers = set(_children(os.getpid())) - others
        assert len(workers) == 2, workers
        before, spares_before = _group_pss_bytes(workers), opt.speculation_stats()["spare_bytes"]
        for _ in range(4):
            step()
        after, spares_after = _group_pss_bytes(workers), opt.speculation_stats()["spare_bytes"]
        stats = engine.stats()
    engine_host_bytes = stats["host_bytes"] + (stats["tier_bytes"]["device"]["current"] if device == "sim" else 0)
    assert engine_host_bytes > 2**29, stats["tier_bytes"]  # the model is large enough to see a copy
    # The engine's own new memory is not the workers': speculative spares it took meanwhile (on a
    # host whose free memory varies, e.g. beside other test processes) are left out.
    growth = after - before - (spares_after - spares_before)
    assert growth < 0.05 * engine_host_bytes, (
        f"host memory of this process and its 2 DataLoader workers grew by {growth / 2**20:.1f} MiB over 4 steps "
        f"({growth / engine_host_bytes:.1%} of the engine's {engine_host_bytes / 2**20:.0f} MiB of host memory): "
        "pages the workers inherited were copied as the engine rewrote them")
