"""Sharded chunks through _C: the ChunkManager with a ProcessGroupCommunicator over gloo, on the
sim device, 2 and 4 ranks (each a process)."""

import pytest
import torch
import torch.distributed as dist

import gemini_ext as gx
from dist_utils import run_ranks

_C = gx._C
SHAPES = [(40,), (8, 5), (30,), (7, 3)]  # slots span shard borders at every world size below


def _manager(rank, world_size):
    ctx = _C.DeviceContext("sim", capacity_bytes=2**20, sim_max_copy_delay_us=200, sim_seed=rank)
    mgr = _C.ChunkManager(ctx, world_size=world_size, rank=rank, alignment_bytes=16)
    comm = _C.ProcessGroupCommunicator(dist.group.WORLD, ctx)
    assert (comm.world_size, comm.rank, comm.name) == (world_size, rank, "gloo")
    mgr.set_communicator(comm)
    return ctx, mgr, comm


def _build(mgr, group, dtype, home):
    mgr.create_group(group, dtype, 136, home)  # one chunk
    handles = [mgr.register_tensor(group, f"t{i}", torch.Size(s).numel(), list(s)) for i, s in enumerate(SHAPES)]
    mgr.finalize()
    return handles


def _gather_body(rank, world_size, dtype):
    ctx, mgr, comm = _manager(rank, world_size)
    handles = _build(mgr, "param", dtype, mgr.host_tier)
    info = mgr.chunk_info(0)
    shard = info["shard_numel"]
    assert info["padded_numel"] == shard * world_size
    assert mgr.tier_bytes(mgr.host_tier)["current"] == shard * dtype.itemsize, "a rank stores its shard only"
    # Each rank writes its slice of one global sequence into its shard.
    mgr.shard_view(0, mgr.host_tier).copy_(torch.arange(rank * shard, (rank + 1) * shard).to(dtype))
    for h in handles:
        mgr.transition(h, gx.TensorState.HOLD)
    mgr.access(0)
    for h, (name, offset, numel, shape, _) in zip(handles, info["slots"]):
        expected = torch.arange(offset, offset + numel).to(dtype).view(shape)
        assert torch.equal(mgr.gathered_view(h), expected), name
    assert mgr.traffic()["all_gathers"] == 1 and comm.calls == 1
    whole = mgr.gathered_chunk_view(0)
    assert whole.numel() == info["padded_numel"]
    assert torch.equal(whole, torch.arange(info["padded_numel"]).to(dtype))
    assert mgr.gathered_bytes()["current"] == info["padded_numel"] * dtype.itemsize
    mgr.release(0)
    assert not mgr.chunk_info(0)["gathered"] and mgr.gathered_bytes()["current"] == 0


def _pattern(offset, numel):
    return (torch.arange(offset, offset + numel) % 16).float()  # sums stay exact in bf16


def _reduce_body(rank, world_size, dtype):
    ctx, mgr, comm = _manager(rank, world_size)
    handles = _build(mgr, "grad", dtype, mgr.host_tier)
    info = mgr.chunk_info(0)
    shard, padded = info["shard_numel"], info["padded_numel"]
    mgr.allocate_gathered(0)
    mgr.gathered_chunk_view(0).zero_()  # uninitialised: padding and alignment gaps too
    for h, (name, offset, numel, shape, _) in zip(handles, info["slots"]):
        mgr.gathered_view(h).copy_(((rank + 1) * _pattern(offset, numel)).to(dtype).view(shape))
        for state in ("HOLD", "COMPUTE", "HOLD_AFTER_BWD", "READY_FOR_REDUCE"):
            mgr.transition(h, getattr(gx.TensorState, state))
    mgr.reduce_scatter(0)
    mgr.reduce(0)
    total = world_size * (world_size + 1) // 2  # sum of (rank + 1)
    got = mgr.shard_view(0, "device").float()
    full = torch.zeros(padded)
    for (_, offset, numel, _, _) in info["slots"]:
        full[offset:offset + numel] = _pattern(offset, numel)
    expected = (total * full)[rank * shard:(rank + 1) * shard].to(dtype).float()
    assert torch.equal(got, expected), (rank, got, expected)
    assert not mgr.chunk_info(0)["gathered"]
    assert mgr.traffic()["reduce_scatters"] == 1


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shards_all_gather_into_the_whole_chunk(world_size, dtype):
    run_ranks(world_size, _gather_body, dtype)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_reduce_scatter_into_each_shard(world_size, dtype):
    run_ranks(world_size, _reduce_body, dtype)


def test_a_communicator_of_another_size_is_refused():
    run_ranks(2, _mismatch_body)


def _mismatch_body(rank, world_size):
    ctx = _C.DeviceContext("sim", capacity_bytes=2**20)
    mgr = _C.ChunkManager(ctx)  # world size 1
    with pytest.raises(gx.UsageError, match="world size"):
        mgr.set_communicator(_C.ProcessGroupCommunicator(dist.group.WORLD, ctx))
