"""ZeRO-3 across ranks: gloo process groups on the sim device (2 and 4 ranks, each a process).

Each rank trains on its slice of the global batch; the result must match plain single-process
PyTorch trained on the whole global batch (gradients are averaged over ranks, as with DDP)."""

import contextlib
import json
import os

import pytest
import torch
import torch.distributed as dist

import gemini_ext as gx
from dist_utils import run_ranks, run_torchrun
from parity_utils import (LR, WD, batch, chunk_cap, close_on_a_nearly_full_device, config, make_models,
                          max_relative_difference, torch_device, train_reference)

STEPS = 6
# The global batch's mean gradient is computed as the mean of per-rank means: the same value in
# another summation order, so fp32 rounding differs (about 1e-7 relative per gradient), and Adam's
# m / sqrt(v) lifts such differences on near-zero gradients. Single-process parity uses 1e-5.
PARAM_TOLERANCE = 5e-5
GLOBAL_BATCH = 4
CHUNK_BYTES_FP32 = 4096 * 4


def _slice(t, rank, world_size):
    per = t.shape[0] // world_size
    return t[rank * per:(rank + 1) * per]


def _train_sharded(model, cfg, rank, world_size, steps=STEPS, global_batch=GLOBAL_BATCH, setup=None,
                   param_init_fn=None):
    losses = []
    with gx.enable(model, cfg, process_group=dist.group.WORLD, param_init_fn=param_init_fn) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        if setup is not None:
            setup(engine)
        for step in range(steps):
            x, y = batch(model.cfg, step, engine.compute_device, batch_size=global_batch)
            loss = model(_slice(x, rank, world_size), _slice(y, rank, world_size))
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world_size)
        stats = engine.stats()
        state = engine.state_dict()
    return losses, stats, state


def _parity_body(rank, world_size, overrides, tolerance, device="sim"):
    overrides = dict(overrides)
    global_batch = overrides.pop("_global_batch", GLOBAL_BATCH)
    model, reference = make_models()
    precision = overrides.get("precision", "fp32")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    ref_losses = train_reference(reference, STEPS, torch_device(device), dtype=dtype,
                                 max_norm=overrides.get("max_norm", 0.0), batch_size=global_batch)
    losses, stats, state = _train_sharded(model, config(device, **overrides), rank, world_size,
                                          global_batch=global_batch)
    assert losses == pytest.approx(ref_losses, rel=tolerance), (losses, ref_losses)
    assert stats["optimizer_steps"] == STEPS
    assert stats["distributed"]["ranks_on_host"] == world_size, "the ranks sharing this host's memory, counted"
    if precision == "fp32":
        diffs = max_relative_difference(model, reference)  # the model holds the trained values after close
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] <= PARAM_TOLERANCE, f"rank {rank}: {worst}: {diffs[worst]:.3g} relative"
        for name, value in reference.state_dict().items():
            assert torch.allclose(state[name], value.cpu(), rtol=PARAM_TOLERANCE, atol=1e-6), name
    traffic = stats["traffic"]
    assert traffic["all_gathers"] >= STEPS * 2, "parameter chunks are gathered in forward and in backward"
    assert traffic["reduce_scatters"] >= STEPS
    assert traffic["gather_prefetches"] > 0, "once the access order is recorded, chunks are gathered ahead"


CASES = {
    "optim_on_host": ({}, 1e-5),
    "optim_on_device": ({"offload_optim_frac": 0.0}, 1e-5),
    "half_and_half_params_home_on_host": ({"offload_optim_frac": 0.5, "offload_param_frac": 0.5}, 1e-5),
    "keep_half_gathered": ({"shard_param_frac": 0.5}, 1e-5),
    "clipping": ({"max_norm": 0.05}, 1e-5),
    "tiny_budget": ({"sim_capacity": 8 * CHUNK_BYTES_FP32}, 1e-5),
    "bf16": ({"precision": "bf16"}, 2e-2),
    "bf16_optimizer_state": ({"precision": "bf16", "optimizer_state_dtype": "bf16"}, 2e-2),
    "auto": ({"placement_policy": "auto", "sim_capacity": 40 * CHUNK_BYTES_FP32}, 1e-5),
    "const": ({"placement_policy": "const", "const_gpu_budget": 8 * CHUNK_BYTES_FP32}, 1e-5),
    "fp16_loss_scaling": ({"precision": "fp16"}, 5e-3),
    "step_in_backward": ({"optimizer_step_in_backward": True, "offload_optim_frac": 0.5}, 1e-5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_single_process_training(case):
    overrides, tolerance = CASES[case]
    run_ranks(2, _parity_body, overrides, tolerance)


def test_two_ranks_launched_by_torchrun_match_single_process_training(tmp_path):
    """The launcher users run (environment rendezvous), which the two-GPU tests use with NCCL."""
    overrides, tolerance = CASES["optim_on_host"]
    run_torchrun(2, _parity_body, overrides, tolerance, tmp_dir=str(tmp_path))


@pytest.mark.parametrize("case", ["optim_on_host", "optim_on_device"])
def test_four_ranks_match_single_process_training(case):
    overrides, tolerance = CASES[case]
    run_ranks(4, _parity_body, overrides, tolerance)


def test_an_odd_number_of_ranks_pads_shards_and_matches():
    """3 ranks: every chunk padded to 3 aligned shards; the global batch of 3 splits evenly."""
    run_ranks(3, _parity_body, {"offload_optim_frac": 0.5, "_global_batch": 3}, 1e-5)


@pytest.mark.parametrize("extra_dp_size", [2, 4])
def test_replicas_of_zero_groups_match_single_process_training(extra_dp_size):
    """HSDP: 4 ranks as extra_dp_size replicas of ZeRO groups of 4 / extra_dp_size ranks (4: plain
    data parallelism, every rank holding whole chunks)."""
    run_ranks(4, _parity_body, {"extra_dp_size": extra_dp_size, "max_norm": 0.05}, 1e-5)


def _hsdp_layout_body(rank, world_size):
    model, _ = make_models()
    with gx.enable(model, config("sim", extra_dp_size=2), process_group=dist.group.WORLD) as engine:
        assert (engine.world_size, engine.rank, engine.replica_index) == (2, rank % 2, rank // 2)
        assert engine.stats()["distributed"] == {"zero_world_size": 2, "zero_rank": rank % 2, "replicas": 2,
                                                 "replica_index": rank // 2, "backend": "gloo", "ranks_on_host": 4}
        assert dist.get_process_group_ranks(engine.replica_group) == [rank % 2, rank % 2 + 2]
        info = engine.chunk_info(engine.internal.chunks.group_chunk_ids("param")[0])
        assert info["shard_numel"] * 2 == info["padded_numel"], "sharded over the ZeRO group of 2, not over 4"


def test_hsdp_groups_are_blocks_of_neighbours():
    run_ranks(4, _hsdp_layout_body)


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["optim_on_host", "optim_on_device", "keep_half_gathered", "bf16"])
def test_world_size_one_over_nccl_matches_single_process_training(case):
    """The sharded path on the GPU: an explicit NCCL group of one rank gathers and reduce-scatters
    through NCCL (stream-ordered on the compute stream) like a larger group would."""
    overrides, tolerance = CASES[case]
    run_ranks(1, _parity_body, overrides, tolerance, "cuda", backend="nccl")


def _collectives_body(rank, world_size, device="sim"):
    model, _ = make_models()
    cfg = config(device, max_prefetch=0, max_norm=1.0)  # clipping: the norm is all-reduced at each step
    with gx.enable(model, cfg, process_group=dist.group.WORLD) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        n_chunks = engine.stats()["num_param_chunks"]
        for step in range(3):
            before = engine.internal.zero_comm.calls
            t0 = dict(engine.internal.chunks.traffic())
            x, y = batch(model.cfg, step, engine.compute_device, batch_size=GLOBAL_BATCH)
            model(_slice(x, rank, world_size), _slice(y, rank, world_size)).backward()
            opt.step()
            opt.zero_grad()
            t1 = engine.internal.chunks.traffic()
            gathers = t1["all_gathers"] - t0["all_gathers"]
            scatters = t1["reduce_scatters"] - t0["reduce_scatters"]
            # A chunk is gathered when the access stream reaches it and stays gathered while in
            # use; idle, it is re-sharded when the stream moves on: at most one all-gather per run
            # of equal chunk ids in the iteration's access order, at least one per chunk, and the
            # same number on every rank (collectives must match). Each chunk's gradients are
            # reduce-scattered once; the step all-reduces the squared gradient norm once.
            order = engine.internal.runtime.trace_info()["recorded"]
            runs = sum(1 for i, c in enumerate(order) if i == 0 or order[i - 1] != c)
            if step > 0:  # the trace of the first iteration closes at its step
                assert n_chunks <= gathers <= runs, (gathers, runs, order)
            counts = [None] * world_size
            dist.all_gather_object(counts, (gathers, scatters))
            assert len(set(counts)) == 1, counts
            assert scatters == n_chunks, (scatters, n_chunks)
            assert engine.internal.zero_comm.calls - before == gathers + scatters + 1
        for c in engine.internal.chunks.group_chunk_ids("state0"):  # fp32 precision: no separate master group
            info = engine.internal.chunks.chunk_info(c)
            assert info["shard_numel"] * world_size == info["padded_numel"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_per_step_are_counted(world_size):
    run_ranks(world_size, _collectives_body)


# --- sharded checkpoints ----------------------------------------------------------------------

def _train_steps(model, engine, opt, steps, first_step, rank, world_size):
    for step in range(first_step, first_step + steps):
        x, y = batch(model.cfg, step, engine.compute_device, batch_size=GLOBAL_BATCH)
        model(_slice(x, rank, world_size), _slice(y, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()


def _save_body(rank, world_size, directory, extra_dp_size=1, device="sim", state_dtype="fp32"):
    model, _ = make_models()
    cfg = config(device, offload_optim_frac=0.5, extra_dp_size=extra_dp_size, optimizer_state_dtype=state_dtype)
    with gx.enable(model, cfg, process_group=dist.group.WORLD) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        _train_steps(model, engine, opt, 3, 0, rank, world_size)
        engine.save_checkpoint(f"{directory}/ckpt")
        expected = {"model": engine.state_dict(), "optimizer": opt.state_dict()}  # collective reads
        _train_steps(model, engine, opt, 3, 3, rank, world_size)  # the uninterrupted run
        final = engine.state_dict()
    if rank == 0:
        torch.save({"at_save": expected, "final": final}, f"{directory}/expected.pt")
    files = sorted(os.listdir(f"{directory}/ckpt"))
    zero_size = world_size // extra_dp_size  # one replica writes
    assert files == ["index.json"] + [f"rank{r:05d}-g1.pt" for r in range(zero_size)], files


def _load_body(rank, world_size, directory, same_world, device="sim", state_dtype="fp32"):
    expected = torch.load(f"{directory}/expected.pt", weights_only=False)
    model, _ = make_models(seed=1)  # other initial values: everything must come from the checkpoint
    group = dist.group.WORLD if dist.is_initialized() else None
    cfg = config(device, offload_optim_frac=0.5, optimizer_state_dtype=state_dtype)
    with gx.enable(model, cfg, process_group=group) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        engine.load_checkpoint(f"{directory}/ckpt")
        state = engine.state_dict()
        for key, value in expected["at_save"]["model"].items():
            assert torch.equal(state[key], value), key
        got = opt.state_dict()
        for pos, entry in expected["at_save"]["optimizer"]["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got["state"][pos][k], entry[k]), (pos, k)
            assert float(got["state"][pos]["step"]) == float(entry["step"])
        assert engine.stats()["optimizer_steps"] == 3
        _train_steps(model, engine, opt, 3, 3, rank, world_size)
        final = engine.state_dict()
    for key, value in expected["final"].items():
        if same_world:  # the same ranks continue exactly as the uninterrupted run
            assert torch.equal(final[key], value), key
        else:  # another world size sums gradients in another order
            assert torch.allclose(final[key], value, rtol=PARAM_TOLERANCE, atol=1e-6), key


def test_checkpoint_saved_at_two_ranks_loads_at_one_two_and_four(tmp_path):
    run_ranks(2, _save_body, str(tmp_path))
    with open(tmp_path / "ckpt" / "index.json") as f:
        index = json.load(f)
    assert index["version"] == 2 and index["world_size"] == 2
    assert all(sum(e - b for _, b, e in p["pieces"]) == p["numel"] for p in index["parameters"]), \
        "the ranks' pieces cover every parameter exactly"
    run_ranks(2, _load_body, str(tmp_path), True)
    run_ranks(4, _load_body, str(tmp_path), False)
    _load_body(0, 1, str(tmp_path), False)  # one unsharded process, here


def test_bf16_optimizer_state_saved_at_two_ranks_resumes_exactly(tmp_path):
    """Sharded checkpoints of bf16 moments (half the sets' state on the device, half on the
    host): the same two ranks continue bit-exactly, the rounding's bits coming from the step,
    chunk and element alone."""
    run_ranks(2, _save_body, str(tmp_path), 1, "sim", "bf16")
    run_ranks(2, _load_body, str(tmp_path), True, "sim", "bf16")


def test_checkpoint_saved_by_hsdp_loads_at_two_ranks(tmp_path):
    run_ranks(4, _save_body, str(tmp_path), 2)
    run_ranks(2, _load_body, str(tmp_path), False)


# --- gradient accumulation, frozen parameters, gradients and plain state dicts -----------------

def _accumulation_body(rank, world_size, use_no_sync):
    model, reference = make_models()
    ref_losses = train_reference(reference, 4, torch.device("cpu"), micro_batches=2)
    losses = []
    with gx.enable(model, config("sim"), process_group=dist.group.WORLD) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        for step in range(4):
            total = 0.0
            for micro in range(2):
                x, y = batch(model.cfg, step * 2 + micro, engine.compute_device, batch_size=GLOBAL_BATCH)
                ctx = engine.no_sync() if use_no_sync and micro == 0 else contextlib.nullcontext()
                with ctx:
                    loss = model(_slice(x, rank, world_size), _slice(y, rank, world_size)) / 2
                    loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad()
            t = torch.tensor([total])
            dist.all_reduce(t)
            losses.append(t.item() / world_size)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    diffs = max_relative_difference(model, reference)
    assert max(diffs.values()) <= PARAM_TOLERANCE, diffs


@pytest.mark.parametrize("use_no_sync", [True, False], ids=["no_sync", "two_backwards"])
def test_gradient_accumulation_across_ranks(use_no_sync):
    """Under no_sync the micro-batches accumulate in the gathered gradient buffer and are reduced
    once at the step; without it each backward reduces, and the second adds to the first."""
    run_ranks(2, _accumulation_body, use_no_sync)


def _frozen_and_grad_body(rank, world_size, path):
    model, reference = make_models()
    for m in (model, reference):
        m.blocks[0].qkv.weight.requires_grad_(False)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    with gx.enable(model, config("sim"), process_group=dist.group.WORLD) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        for step in range(3):
            x, y = batch(model.cfg, step, engine.compute_device, batch_size=GLOBAL_BATCH)
            model(_slice(x, rank, world_size), _slice(y, rank, world_size)).backward()
            reference(x, y).backward()
            # engine.grad(p) all-gathers the averaged gradient: every rank calls it, in one order
            for p, r in zip(model.parameters(), reference.parameters()):
                g = engine.grad(p)
                if not r.requires_grad:
                    assert g is None
                    continue
                assert torch.allclose(g, r.grad, rtol=1e-4, atol=1e-6)
                assert g.device.type == "cpu" and g.dtype == torch.float32
                g.zero_()  # a copy of its own: the chunk (and the gathered one kept for reads) keep their values
                assert torch.allclose(engine.grad(p), r.grad, rtol=1e-4, atol=1e-6)
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        engine.save_checkpoint(os.path.join(path, "no-base"), frozen=False)  # the trainable shards only
    diffs = max_relative_difference(model, reference)
    assert max(diffs.values()) <= PARAM_TOLERANCE, diffs
    with open(os.path.join(path, "no-base", "index.json")) as f:
        index = json.load(f)
    assert index["frozen"] is False and "blocks.0.qkv.weight" not in {p["name"] for p in index["parameters"]}
    fresh, _ = make_models(seed=1)  # other values everywhere: the frozen one is not in the checkpoint
    fresh.blocks[0].qkv.weight.requires_grad_(False)
    frozen_before = fresh.blocks[0].qkv.weight.detach().clone()
    with gx.enable(fresh, config("sim"), process_group=dist.group.WORLD) as engine:
        engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        engine.load_checkpoint(os.path.join(path, "no-base"))
    for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(b, frozen_before if name == "blocks.0.qkv.weight" else a), name


def test_frozen_parameters_and_gradients_across_ranks(tmp_path):
    run_ranks(2, _frozen_and_grad_body, str(tmp_path))


def _load_plain_body(rank, world_size, path):
    expected = torch.load(f"{path}/expected.pt", weights_only=False)
    model, _ = make_models(seed=1)
    with gx.enable(model, config("sim"), process_group=dist.group.WORLD) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        engine.load_checkpoint(f"{path}/ckpt")  # format 1, written by one unsharded process
        state = engine.state_dict()
        got = opt.state_dict()
    for key, value in expected["model"].items():
        assert torch.equal(state[key], value), key
    for pos, entry in expected["optimizer"]["state"].items():
        assert torch.equal(got["state"][pos]["exp_avg_sq"], entry["exp_avg_sq"]), pos


def test_single_process_checkpoint_loads_into_two_ranks(tmp_path):
    model, _ = make_models()
    with gx.enable(model, config("sim")) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        for step in range(2):
            x, y = batch(model.cfg, step, engine.compute_device, batch_size=GLOBAL_BATCH)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        engine.save_checkpoint(tmp_path / "ckpt")
        torch.save({"model": engine.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "expected.pt")
    run_ranks(2, _load_plain_body, str(tmp_path))


def _rank0_init_body(rank, world_size):
    model, _ = make_models(seed=rank)  # every rank initialised differently
    rank0, _ = make_models(seed=0)
    with gx.enable(model, config("sim"), process_group=dist.group.WORLD) as engine:
        state = engine.state_dict()
    for key, value in rank0.state_dict().items():
        assert torch.equal(state[key], value), key


def test_every_rank_starts_from_rank_zeros_values():
    """As with DistributedDataParallel: parameters and buffers are broadcast from rank 0."""
    run_ranks(2, _rank0_init_body)


def _sharded_release_body(rank, world_size, device="sim"):
    model, _ = make_models(seed=0)
    if device == "cuda":
        model = model.cuda()  # built on the GPU, as a model that fills it must be
    seen = {}

    def fail(self, *args, **kwargs):
        seen.update({n: p.numel() for n, p in model.named_parameters()})
        raise RuntimeError("injected failure after the chunks were filled")

    from gemini_ext._engine import build
    real = build._start_runtime
    build._start_runtime = fail
    try:
        with pytest.raises(RuntimeError, match="injected") as info:
            gx.enable(model, config(device), process_group=dist.group.WORLD)
    finally:
        build._start_runtime = real
    assert seen and all(n == 0 for n in seen.values()), "every original released before the chunks took over"
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert f"sharded over {world_size} ranks" in note and "Build the model again" in note, note
    assert all(p.numel() == 0 for p in model.parameters())
    model, reference = make_models(seed=0)  # built again, it trains
    with gx.enable(model.cuda() if device == "cuda" else model, config(device),
                   process_group=dist.group.WORLD) as engine:
        state = engine.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(state[key].cpu(), value), key


def test_sharded_enable_releases_the_originals_and_says_so_when_it_fails():
    """Sharded, each rank releases its whole copy of every parameter once its shard is in a
    chunk (a model that fills a GPU cannot sit beside its chunks); a later failure cannot gather
    the values back from the other ranks, so the error says the model must be built again."""
    run_ranks(2, _sharded_release_body)


def _no_room_on_one_rank_body(rank, world_size):
    """Only rank 1 lacks the room to restore the model: the reads at close are collective, so
    neither rank restores it (one rank reading alone would hang the other)."""
    import warnings

    model, _ = make_models(seed=0)
    if rank == 1:
        gx._engine.restore.restore_free_bytes = lambda chunks, device, ranks_on_host: 0
    engine = gx.enable(model, config("sim"), process_group=dist.group.WORLD)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.close()
    assert any("left empty" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert all(p.numel() == 0 for p in model.parameters())


def test_close_restores_on_no_rank_when_one_rank_has_no_room():
    run_ranks(2, _no_room_on_one_rank_body)


# --- two GPUs over NCCL, launched with torchrun (nvidia-h200-x2) ---------------------------------

def _on_cuda(overrides: dict) -> dict:
    """A sim case's overrides for cuda: a sim capacity becomes the const policy's chunk budget."""
    overrides = dict(overrides)
    cap = overrides.pop("sim_capacity", None)
    if cap is not None and overrides.get("placement_policy") != "auto":
        overrides.update(chunk_cap("cuda", cap))
    return overrides


@pytest.mark.cuda
@pytest.mark.multigpu
@pytest.mark.parametrize("case", ["optim_on_host", "optim_on_device", "half_and_half_params_home_on_host",
                                  "keep_half_gathered", "clipping", "tiny_budget", "bf16", "auto",
                                  "fp16_loss_scaling"])
def test_two_gpus_over_nccl_match_single_gpu_training(case, tmp_path):
    """ZeRO-3 over NCCL on two GPUs, one process per GPU started by torchrun: each rank trains on
    its half of the global batch and must match plain PyTorch on one GPU trained on all of it."""
    overrides, tolerance = CASES[case]
    run_torchrun(2, _parity_body, _on_cuda(overrides), tolerance, "cuda", backend="nccl", tmp_dir=str(tmp_path))


@pytest.mark.cuda
@pytest.mark.multigpu
def test_two_gpus_over_nccl_count_their_collectives(tmp_path):
    run_torchrun(2, _collectives_body, "cuda", backend="nccl", tmp_dir=str(tmp_path))


@pytest.mark.cuda
@pytest.mark.multigpu
def test_checkpoint_saved_on_two_gpus_loads_on_one_and_two(tmp_path):
    run_torchrun(2, _save_body, str(tmp_path), 1, "cuda", backend="nccl", tmp_dir=str(tmp_path))
    run_torchrun(2, _load_body, str(tmp_path), True, "cuda", backend="nccl", tmp_dir=str(tmp_path))
    _load_body(0, 1, str(tmp_path), False, "cuda")  # one unsharded process, here


def _uneven_optimizer_body(rank, world_size, device="sim"):
    """Rank 0's CPU optimizer steps finish late (each takes 30 ms longer), rank 1's at once.
    Gathers are collectives: which chunk each rank gathers ahead must not depend on whether its
    own CPU step has finished, or the ranks gather different chunks and train on wrong values
    (or hang)."""
    model, reference = make_models()
    ref_losses = train_reference(reference, STEPS, torch_device(device), batch_size=GLOBAL_BATCH)
    slow = (lambda engine: engine.internal.runtime.set_optimizer_task_delay_us(30_000)) if rank == 0 else None
    losses, stats, _ = _train_sharded(model, config(device), rank, world_size, setup=slow)
    assert losses == pytest.approx(ref_losses, rel=1e-5), (losses, ref_losses)
    assert max(max_relative_difference(model, reference).values()) <= PARAM_TOLERANCE
    assert stats["traffic"]["gather_prefetches"] > 0


def test_ranks_whose_cpu_steps_finish_at_different_times_gather_the_same_chunks():
    run_ranks(2, _uneven_optimizer_body)


@pytest.mark.cuda
@pytest.mark.multigpu
def test_two_gpus_over_nccl_gather_the_same_chunks_when_cpu_steps_finish_at_different_times(tmp_path):
    run_torchrun(2, _uneven_optimizer_body, "cuda", backend="nccl", tmp_dir=str(tmp_path))


@pytest.mark.cuda
@pytest.mark.multigpu
def test_two_gpus_over_nccl_release_the_originals_of_a_model_built_on_them(tmp_path):
    run_torchrun(2, _sharded_release_body, "cuda", backend="nccl", tmp_dir=str(tmp_path))


def _read_to_body(rank, world_size, device="sim"):
    """read_to copies a value from its chunk straight to a device and dtype (close() restores
    parameters with it): the same values as read(), on every rank, sharded or not."""
    model, _ = make_models(seed=0)
    group = dist.group.WORLD if world_size > 1 else None
    with gx.enable(model.cuda() if device == "cuda" else model, config(device, precision="bf16"),
                   process_group=group) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        x, y = batch(model.cfg, 0, engine.compute_device)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        index = {name: engine.parameter_index(p) for name, p in model.named_parameters()}
        reads = {i: engine.internal.runtime.read("param", i) for i in index.values()}
        for i, value in reads.items():
            for target in {torch.device("cpu"), engine.compute_device}:
                for dtype in (torch.float32, torch.bfloat16):
                    got = engine.internal.runtime.read_to("param", i, target, dtype)
                    assert got.device == target and got.dtype == dtype and got.shape == value.shape, (i, got)
                    assert torch.equal(got.cpu(), value.to(dtype)), (i, target, dtype)
        engine.internal.runtime.release_read_cache()
        state = engine.state_dict()
    for name, p in model.named_parameters():  # close() restored the same values, as fp32
        assert p.dtype == torch.float32 and torch.equal(p.detach().cpu(), reads[index[name]]), name
        assert torch.equal(state[name], reads[index[name]]), name


@pytest.mark.parametrize("world_size", [1, 2])
def test_read_to_a_device_and_dtype_matches_read(world_size):
    run_ranks(world_size, _read_to_body)


def _close_on_a_full_device_body(rank, world_size, device="cuda"):
    """Sharded, close() all-gathers each chunk on the device to restore its parameters. With the
    device nearly full, it restores parameters to the GPU only while room for the next gather
    remains; the rest waits on the host and follows once the chunks are freed (otherwise the
    parameters restored first could fill the device and the gather, a collective, would run out
    of memory)."""
    engine, model, expected = close_on_a_nearly_full_device(256 << 20, dist.group.WORLD)
    assert engine._close_staged_params > 0, "the device had room for a few parameters only"
    assert engine._close_params_left_on_host == 0
    for name, p in model.named_parameters():
        assert p.device.type == "cuda", name
        torch.testing.assert_close(p.detach().cpu(), expected[name], rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.multigpu
def test_two_gpus_over_nccl_close_on_a_nearly_full_device(tmp_path):
    run_torchrun(2, _close_on_a_full_device_body, "cuda", backend="nccl", tmp_dir=str(tmp_path))


@pytest.mark.cuda
@pytest.mark.multigpu
def test_two_gpus_over_nccl_read_to_matches_read(tmp_path):
    run_torchrun(2, _read_to_body, "cuda", backend="nccl", tmp_dir=str(tmp_path))


# --- full state dicts on rank 0, bounded ------------------------------------------------------

def _peak_anon_growth(fn):
    """fn()'s result and the most this process's anonymous memory grew while it ran (sampled)."""
    import threading
    from gemini_ext.export import anon_rss_bytes
    before, peak, done = anon_rss_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon_rss_bytes())
            done.wait(0.0005)
    t = threading.Thread(target=sample)
    t.start()
    try:
        result = fn()
    finally:
        done.set()
        t.join()
    return result, max(peak[0], anon_rss_bytes()) - before


def _rank0_state_dict_body(rank, world_size, path):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    torch.manual_seed(0)
    width, layers = 512, 64  # 64 MiB of fp32 weights in 1 MiB tensors, chunks of 1 MiB
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = gx.GeminiConfig(device="sim", precision="fp32", chunk_config_dict={"chunk_size": width * width})
    with gx.enable(model, cfg, process_group=dist.group.WORLD) as engine:
        # rank 0 only first: memory the C allocator keeps from an earlier dictionary would hide growth
        first, grown = _peak_anon_growth(lambda: engine.state_dict(StateDictOptions(full_state_dict=True,
                                                                                    cpu_offload=True)))
        share, grown_share = _peak_anon_growth(lambda: engine.state_dict(StateDictOptions(full_state_dict=False)))
        share_rows = sum(v.to_local().shape[0] for v in share.values())
        del share
        everywhere, grown_all = _peak_anon_growth(engine.state_dict)
        del everywhere
    with open(os.path.join(path, f"rank{rank}.json"), "w") as f:
        json.dump({"grown_all": grown_all, "grown": grown, "grown_share": grown_share, "share_rows": share_rows,
                   "keys": len(first),
                   "equal": all(torch.equal(first[k], expected[k]) for k in first),
                   "model_bytes": layers * width * width * 4, "tensor_bytes": width * width * 4}, f)


def test_a_rank0_full_state_dict_holds_one_chunk_on_the_other_ranks(tmp_path):
    """StateDictOptions(full_state_dict=True, cpu_offload=True) at four gloo ranks: rank 0 gets
    the dictionary, the others {} with their memory bounded by a chunk (the default gives every
    rank the whole dictionary: its growth is printed beside)."""
    run_ranks(4, _rank0_state_dict_body, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    growth = [(round(x["grown_all"] / 2**20, 1), round(x["grown"] / 2**20, 1), round(x["grown_share"] / 2**20, 1))
              for x in reports]
    print("peak anonymous growth per rank, MiB (default, rank 0 only, sharded):", growth)
    # the sharded state dict (for DCP): each rank a quarter of every weight's rows
    assert [x["share_rows"] for x in reports] == [64 * 512 // 4] * 4, growth
    model_bytes = reports[0]["model_bytes"]
    # (rank 0's own growth understates its dictionary: it reuses the heap the model's original
    # tensors left when enable() took them into chunks)
    assert reports[0]["keys"] == 64 and reports[0]["equal"], growth
    for r in reports[1:]:
        assert r["keys"] == 0, "the other ranks get {}"
        # one parameter and the gathered chunk of the reads at a time, plus the buffers the first
        # gathers allocate and what the C allocator keeps (measured 4 to 22 MiB of this 64 MiB
        # model, run to run: anonymous memory in a process that freed the model's tensors is a
        # noisy figure, so the bound is loose)
        assert r["grown"] < model_bytes // 2, growth
