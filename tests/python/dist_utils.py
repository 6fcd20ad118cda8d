"""Runs a test body on N processes joined by a torch.distributed process group (gloo on CPU,
NCCL when asked on a GPU machine). The body is a module-level function body(rank, world_size,
*args); a failure on any rank fails the test with that rank's traceback."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, backend, body, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if backend == "nccl":
        import torch
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        body(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, body, *args, backend: str = "gloo") -> None:
    mp.start_processes(_entry, args=(world_size, free_port(), backend, body, args), nprocs=world_size,
                       join=True, start_method="spawn")
