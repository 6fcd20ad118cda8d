"""One rank of dist_utils.run_torchrun: joins torchrun's process group (environment rendezvous),
picks the GPU of LOCAL_RANK under NCCL, and runs the pickled test body."""

import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/python: the shared helpers

import torch
import torch.distributed as dist


def main(job_path: str) -> None:
    with open(job_path, "rb") as f:
        body, args, backend = pickle.load(f)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    try:
        body(dist.get_rank(), dist.get_world_size(), *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
