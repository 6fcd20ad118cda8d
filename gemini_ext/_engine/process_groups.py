"""The ranks an engine works with, and the few collectives the Python side runs over them.

- the data-parallel group: every rank training the same model (the group passed to enable(),
  else the default group when it has more than one rank; None for one process);
- the ZeRO group: the ranks a chunk is sharded over; with `extra_dp_size` E (HSDP) the data-
  parallel ranks split into E blocks of consecutive ranks (neighbours, e.g. the GPUs of one node,
  share the all-gathers);
- the replica group: the ranks holding the same shard in the other blocks.
Decisions every rank must take alike (placement from measurements, whether close() can restore
the model) go through `reduce` and `all_agree` here.
"""

from __future__ import annotations

import socket
import zlib

import torch
import torch.distributed as dist


def resolve_process_group(process_group):
    """The data-parallel group: the one passed, else the default group when torch.distributed is
    initialised with more than one rank; None (one unsharded process) otherwise. Passing a group
    of one rank explicitly runs the sharded path over it (its collectives included)."""
    if process_group is not None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("enable(process_group=...): torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group() first (torchrun sets up its environment).")
        return process_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def split_groups(group, extra_dp_size: int):
    """(ZeRO group, replica group, replica index) of this rank within the data-parallel `group`.

    With W ranks and extra_dp_size E, the ZeRO groups are E blocks of Z = W / E consecutive
    ranks, and replica group i holds the i-th rank of every block. Every rank creates every
    group, in the same order, as torch.distributed.new_group requires. Without extra replicas
    the ZeRO group is `group`."""
    if group is None or extra_dp_size == 1:
        return group, None, 0
    ranks = dist.get_process_group_ranks(group)
    zero_size = len(ranks) // extra_dp_size
    me = dist.get_rank()
    zero = replica = None
    index = 0
    for k in range(extra_dp_size):
        members = ranks[k * zero_size:(k + 1) * zero_size]
        g = dist.new_group(members)
        if me in members:
            zero, index = g, k
    for i in range(zero_size):
        members = ranks[i::zero_size]
        g = dist.new_group(members)
        if me in members:
            replica = g
    return zero, replica, index


class DataParallelGroups:
    """The data-parallel, ZeRO and replica groups of one engine (see the note above)."""

    def __init__(self, data_parallel, extra_dp_size: int):
        self.data_parallel = data_parallel
        dp_world = dist.get_world_size(data_parallel) if data_parallel is not None else 1
        if dp_world % extra_dp_size != 0:
            raise ValueError(f"extra_dp_size={extra_dp_size}: it must divide the world size ({dp_world}); "
                             "the ZeRO group is world_size / extra_dp_size ranks.")
        self.extra_dp_size = extra_dp_size
        self.zero, self.replica, self.replica_index = split_groups(data_parallel, extra_dp_size)
        self.world_size = dist.get_world_size(self.zero) if self.zero is not None else 1
        self.rank = dist.get_rank(self.zero) if self.zero is not None else 0
        self.device = torch.device("cpu")  # where collectives' tensors live: set_device() on cuda
        self._ranks_on_host = None

    def set_device(self, device: torch.device) -> None:
        self.device = device

    @property
    def distributed(self) -> bool:
        return self.data_parallel is not None

    def from_rank0(self, value: torch.Tensor) -> torch.Tensor:
        """Several ranks: rank 0's value, as DistributedDataParallel does at construction, so that
        ranks that initialised their models differently still train one model. Itself otherwise."""
        if self.data_parallel is None:
            return value
        buf = value.detach().to(self.device, copy=True).contiguous()
        dist.broadcast(buf, src=dist.get_global_rank(self.data_parallel, 0), group=self.data_parallel)
        return buf

    def reduce(self, value: float, op: str) -> float:
        """`value` reduced over the data-parallel ranks with "min" or "max" (itself for one process)."""
        if self.data_parallel is None:
            return value
        ops = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=ops[op], group=self.data_parallel)
        return t.item()

    def all_agree(self, ok: bool) -> bool:
        """True when `ok` holds on every data-parallel rank (itself for one process)."""
        if self.data_parallel is None:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.data_parallel)
        return bool(flag.item())

    def ranks_on_host(self) -> int:
        """Data-parallel ranks on this rank's host (itself included): those whose hostnames match,
        gathered once (as a hash, over the groups' device) and kept. The host memory they share is
        divided by it (placement/host_memory.py)."""
        if self._ranks_on_host is None:
            if self.data_parallel is None:
                self._ranks_on_host = 1
            else:
                name = socket.gethostname().encode()
                mine = torch.tensor([zlib.crc32(name) << 16 | len(name) & 0xFFFF], dtype=torch.int64,
                                    device=self.device)
                every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.data_parallel))]
                dist.all_gather(every, mine, group=self.data_parallel)
                self._ranks_on_host = sum(int(t.item() == mine.item()) for t in every)
        return self._ranks_on_host

    def barrier(self) -> None:
        if self.data_parallel is not None:
            dist.barrier(self.data_parallel)

    def summary(self) -> dict:
        return {"zero_world_size": self.world_size, "zero_rank": self.rank,
                "replicas": self.extra_dp_size if self.zero is not None else 1,
                "replica_index": self.replica_index, "ranks_on_host": self._ranks_on_host,
                "backend": dist.get_backend(self.zero) if self.zero is not None else None}
