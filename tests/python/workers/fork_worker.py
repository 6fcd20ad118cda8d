"""The measurement of test_fork.py in a fresh interpreter: one engine training with a persistent
DataLoader of two forked workers; prints one JSON line (the workers' Pss growth over four steps,
the engine's host bytes, the workers seen).

    python tests/python/workers/fork_worker.py sim|cuda
"""

import json
import os
import sys

import torch

import gemini_ext as gx

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


def _workers_pss_bytes(workers: set) -> int:
    """Pss of `workers` (this process's children, all alive). A page the parent copies on writing it
    was shared by the parent and the workers; after the copy only the workers share it, so their Pss
    grows by 1 / (workers + 1) of it. Pages the parent touches for the first time (memory it reserved
    earlier) are its own and leave the workers' Pss as it was."""
    alive = workers & set(_children(os.getpid()))
    assert alive == workers, f"workers {sorted(workers - alive)} ended"
    return sum(_pss_bytes(k) for k in workers)


class _Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((WIDTH,), float(i % 7) / 7)


def main(device: str) -> dict:
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
        others = set(_children(os.getpid()))  # children that are not the loader's workers, if any
        batches = iter(loader)

        def step():
            x = next(batches).to(compute, dtype)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            engine.synchronize()

        step()  # the workers start; the optimizer state exists
        workers = set(_children(os.getpid())) - others
        before = _workers_pss_bytes(workers)
        for _ in range(4):
            step()
        after = _workers_pss_bytes(workers)
        stats = engine.stats()
    engine_host_bytes = stats["host_bytes"] + (stats["tier_bytes"]["device"]["current"] if device == "sim" else 0)
    return {"workers": len(workers), "workers_pss_growth": after - before, "engine_host_bytes": engine_host_bytes}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
