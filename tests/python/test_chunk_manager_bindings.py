"""The C++ ChunkManager through _C, on the sim device and (marked cuda) on a GPU."""

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES

_C = gx._C


def make_manager(device, capacity=64 * 2**20, delay_us=0):
    if device == "sim":
        ctx = _C.DeviceContext("sim", capacity_bytes=capacity, sim_max_copy_delay_us=delay_us, sim_seed=1)
    else:
        ctx = _C.DeviceContext("cuda", device_index=0, capacity_bytes=capacity)
    return ctx, _C.ChunkManager(ctx)


def build(mgr, shapes, dtype=torch.float32, chunk=4096):
    mgr.create_group("p", dtype, chunk, mgr.host_tier)
    handles = [mgr.register_tensor("p", f"t{i}", int(torch.Size(s).numel()), list(s)) for i, s in enumerate(shapes)]
    mgr.finalize()
    return handles


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_values_survive_round_trips_between_tiers(device, dtype):
    ctx, mgr = make_manager(device, delay_us=100 if device == "sim" else 0)
    shapes = [(64, 33), (7,), (1000,), (3, 5, 7), ()]
    handles = build(mgr, shapes, dtype)
    torch.manual_seed(0)
    ref = [torch.randn(s).to(dtype) for s in shapes]
    host = mgr.host_tier
    for h, r in zip(handles, ref):
        mgr.tensor_view(h, host).copy_(r)
        mgr.transition(h, gx.TensorState.HOLD)
    for _ in range(3):
        for c in range(mgr.num_chunks):
            mgr.move(c, "device", async_=True)
        for c in range(mgr.num_chunks):
            mgr.wait(c)
        for h, r in zip(handles, ref):
            v = mgr.tensor_view(h, "device")
            assert v.shape == r.shape and v.dtype == dtype
            assert v.device.type == ("cuda" if device == "cuda" else "cpu")
            torch.testing.assert_close(v.cpu(), r, rtol=0, atol=0)
        for c in range(mgr.num_chunks):
            mgr.move(c, host, async_=True)
    for c in range(mgr.num_chunks):
        mgr.wait(c)
    for h, r in zip(handles, ref):
        torch.testing.assert_close(mgr.tensor_view(h, host), r, rtol=0, atol=0)
    traffic = mgr.traffic()
    assert traffic["h2d_bytes"] == traffic["d2h_bytes"] > 0
    assert mgr.tier_bytes("device")["current"] == 0
    assert mgr.tier_bytes("device")["peak"] == sum(mgr.chunk_info(c)["shard_numel"] for c in range(mgr.num_chunks)) * \
        torch.tensor([], dtype=dtype).element_size()


@pytest.mark.parametrize("device", DEVICES)
def test_views_alias_chunk_memory(device):
    ctx, mgr = make_manager(device)
    h = build(mgr, [(4, 4), (8,)])
    for x in h:
        mgr.transition(x, gx.TensorState.HOLD)
    mgr.move(0, "device")
    whole = mgr.shard_view(0, "device")
    a = mgr.tensor_view(h[0], "device")
    b = mgr.tensor_view(h[1], "device")
    a.fill_(3.0)
    b.fill_(5.0)
    info = mgr.chunk_info(0)
    off_b = info["slots"][1][1]
    assert whole[:16].eq(3.0).all() and whole[off_b:off_b + 8].eq(5.0).all()
    assert whole[16:off_b].eq(0).all(), "alignment padding is zero"
    assert b.data_ptr() - whole.data_ptr() == off_b * 4


def test_errors_map_to_python_exceptions():
    ctx, mgr = make_manager("sim", capacity=4096)
    h = build(mgr, [(100,)], chunk=100)
    with pytest.raises(gx.IllegalTransition, match="t0.*chunk 0.*FREE -> COMPUTE"):
        mgr.transition(h[0], gx.TensorState.COMPUTE)
    assert issubclass(gx.IllegalTransition, gx.InternalError) and issubclass(gx.InternalError, RuntimeError)
    with pytest.raises(ValueError, match="no copy on tier device"):
        mgr.tensor_view(h[0], "device")
    with pytest.raises(gx.UsageError, match="tier"):
        mgr.move(0, "gpu")
    with pytest.raises(ValueError, match="chunk id"):
        mgr.chunk_info(5)
    mgr.transition(h[0], gx.TensorState.HOLD)
    with pytest.raises(gx.InternalError, match="bug"):
        mgr.reduce(0)


def test_sim_capacity_is_an_out_of_memory_error_naming_the_knob():
    ctx, mgr = make_manager("sim", capacity=1000)
    build(mgr, [(200,), (200,)], chunk=200)  # 200 floats, padded to 208 (64-byte alignment): 832 bytes
    mgr.move(0, "device")
    with pytest.raises(gx.OutOfMemoryError, match="sim_capacity"):
        mgr.move(1, "device")
    assert mgr.tier_bytes("device")["current"] == mgr.chunk_info(0)["shard_numel"] * 4 == 832
    assert "pageable_host" in mgr.chunk_info(1)["shard_tiers"]


def test_reduce_and_release_follow_the_predicates():
    ctx, mgr = make_manager("sim")
    h = build(mgr, [(10,), (10,)])
    S = gx.TensorState
    for x in h:
        mgr.transition(x, S.HOLD)
        mgr.transition(x, S.COMPUTE)
    mgr.access(0)
    assert mgr.chunk_info(0)["gathered"]
    mgr.gathered_view(h[0]).add_(1)
    mgr.transition(h[0], S.READY_FOR_REDUCE)
    mgr.transition(h[1], S.HOLD_AFTER_BWD)
    assert not mgr.chunk_info(0)["can_reduce"]
    mgr.transition(h[1], S.READY_FOR_REDUCE)
    assert mgr.chunk_info(0)["can_reduce"]
    mgr.reduce(0)
    assert [s[4] for s in mgr.chunk_info(0)["slots"]] == [S.HOLD, S.HOLD]
    mgr.release(0)
    assert not mgr.chunk_info(0)["gathered"]
    assert mgr.traffic()["reductions"] == 1


def test_pinned_tier_on_cuda_and_pageable_on_sim():
    _, sim_mgr = make_manager("sim")
    assert sim_mgr.host_tier == "pageable_host"


@pytest.mark.cuda
def test_cuda_host_tier_is_pinned():
    ctx, mgr = make_manager("cuda")
    assert ctx.host_memory_is_pinned and mgr.host_tier == "pinned_host"
    h = build(mgr, [(1024,)])
    assert mgr.tensor_view(h[0], "pinned_host").is_pinned()


@pytest.mark.cuda
def test_cuda_gpu_limit_is_an_out_of_memory_error():
    ctx, mgr = make_manager("cuda", capacity=1 << 20)
    build(mgr, [(200_000,), (200_000,)], chunk=200_000)  # 800 KB chunks
    mgr.move(0, "device")
    with pytest.raises(gx.OutOfMemoryError, match="gpu_memory_limit"):
        mgr.move(1, "device")
