"""Runs a test body on N processes joined by a torch.distributed process group (gloo on CPU,
NCCL when asked on a GPU machine). The body is a module-level function body(rank, world_size,
*args); a failure on any rank fails the test with that rank's traceback.

run_ranks starts the processes itself, forked from a server process that imported torch, its
optimizer machinery and gemini_ext once (multiprocessing's forkserver): a rank then starts in
milliseconds instead of the seconds those imports take, and nothing of the test process (its
threads, its CUDA context) is inherited. run_torchrun launches them with torchrun, as users do
(environment rendezvous, LOCAL_RANK picks the GPU)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the fork server; torch._dynamo is what an optimizer's first step imports.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "gemini_ext", "dist_utils", "parity_utils"]
multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)  # read when the server starts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, backend, body, args):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        body(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, body, *args, backend: str = "gloo") -> None:
    mp.start_processes(_entry, args=(world_size, free_port(), backend, body, args), nprocs=world_size,
                       join=True, start_method="forkserver")


def run_torchrun(world_size: int, body, *args, backend: str = "gloo", tmp_dir: str, timeout: int = 900) -> str:
    """Runs body(rank, world_size, *args) on every rank of `torchrun --nproc-per-node world_size`;
    returns the combined output. The body and its arguments travel pickled (by module and name)."""
    job = os.path.join(tmp_dir, "torchrun_job.pkl")
    with open(job, "wb") as f:
        pickle.dump((body, args, backend), f)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size),
           "--master-port", str(free_port()), os.path.join(here, "workers", "torchrun_worker.py"), job]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"torchrun exited with {proc.returncode}:\n{out[-6000:]}"
    return out
