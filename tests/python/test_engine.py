"""enable(): parameters live in chunks, training matches plain PyTorch, close restores them."""

import sys

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from gemini_ext.models import GPT, GPT_PRESETS, synthetic_batch
from parity_utils import close_on_a_nearly_full_device


def _cfg(device, **kw):
    kw.setdefault("precision", "fp32")
    kw.setdefault("offload_optim_frac", 0.0)
    return gx.GeminiConfig(device=device, min_chunk_size_m=0.01, search_range_m=0.02, **kw)


def _train(model, opt, steps, device, backward):
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(model.cfg, 4, 32, step, device)
        loss = model(x, y)
        backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("device", DEVICES)
def test_parameters_are_views_into_chunk_slots_while_enabled(device):
    model = GPT(GPT_PRESETS["tiny"])
    with gx.enable(model, _cfg(device)) as engine:
        for name, p in model.named_parameters():
            chunk_id, slot = engine.parameter_slot(p)
            chunk = engine.internal.chunks.shard_view(chunk_id, "device")
            offset = engine.chunk_info(chunk_id)["slots"][slot][1]
            assert p.data_ptr() == chunk.data_ptr() + offset * p.element_size(), name
            assert p.untyped_storage().data_ptr() == chunk.data_ptr(), "one storage per chunk"
            assert p.device.type == ("cuda" if device == "cuda" else "cpu")
        assert model.head.weight is model.tok_emb.weight, "tied weights stay tied"
        stats = engine.stats()
        assert stats["tier_bytes"]["device"]["current"] > 0
        # offload_optim_frac=0: parameter chunks went to the device once each; the optimizer state
        # was allocated there directly (no copy, nothing of it on the host)
        chunks = engine.internal.chunks
        moved = sum(chunks.chunk_info(c)["shard_numel"] * 4 for c in chunks.group_chunk_ids("param"))
        assert stats["traffic"]["h2d_bytes"] == moved
        for g in ("state0", "state1"):  # the optimizer's state chunks: no memory until it exists
            for c in engine.internal.chunks.group_chunk_ids(g):
                assert engine.internal.chunks.chunk_info(c)["shard_tiers"] == "none", (g, c)
        engine.optimizer(torch.optim.AdamW)
        assert engine.stats()["traffic"]["h2d_bytes"] == moved
        for g in ("state0", "state1"):
            for c in engine.internal.chunks.group_chunk_ids(g):
                assert engine.internal.chunks.chunk_info(c)["shard_tiers"] == "device", (g, c)
        for c in engine.internal.chunks.group_chunk_ids("grad"):  # born on the device in backward
            assert engine.internal.chunks.chunk_info(c)["shard_tiers"] == "none", c


def test_close_restores_ordinary_parameters_on_their_original_device():
    model = torch.nn.Linear(8, 8)
    engine = gx.enable(model, _cfg("sim"))
    with torch.no_grad():
        model.weight.fill_(2.0)
    gm = engine.internal.runtime
    engine.close()
    engine.close()  # idempotent
    assert sys.getrefcount(gm) == 2, "nothing but this test holds the manager: its chunks are freed at close"
    del gm
    assert model.weight.device.type == "cpu" and model.weight.eq(2.0).all()
    storage = model.weight.untyped_storage()
    assert storage.nbytes() == model.weight.numel() * 4, "an ordinary tensor, not a view into a chunk"
    with pytest.raises(RuntimeError, match="closed"):
        engine.optimizer(torch.optim.AdamW)
    assert engine.stats()["num_chunks"] > 0  # a snapshot taken at close


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_enable_releases_the_models_tensors_and_gives_them_back_when_it_fails(monkeypatch, precision):
    """enable() releases each original tensor once its exact value is in a chunk (a model filling
    most of host memory cannot exist twice); when enable() fails after that, every parameter gets
    its value, dtype, shape and device back from the chunks."""
    model = GPT(GPT_PRESETS["tiny"])
    model.blocks[0].ln1.weight.requires_grad_(False)  # a frozen one too
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = {}

    def fail(self, *args, **kwargs):
        seen.update({n: p.numel() for n, p in model.named_parameters()})
        raise RuntimeError("injected failure after the chunks were filled")

    monkeypatch.setattr(gx._engine.build, "_start_runtime", fail)
    with pytest.raises(RuntimeError, match="injected"):
        gx.enable(model, _cfg("sim", precision=precision))
    # every original is held exactly by a chunk, so all are released: fp32 chunks under fp32; under
    # bf16 the trainable ones' fp32 masters and the frozen one's exact fp32 companion (layout.py)
    assert all(n == 0 for n in seen.values()), seen
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.device.type == "cpu"
        assert torch.equal(p.detach(), before[name]), name
    monkeypatch.undo()
    with gx.enable(model, _cfg("sim")):  # and the model is usable again
        pass


def test_close_gives_memory_back_before_it_restores_and_one_chunk_set_at_a_time(monkeypatch):
    """close() first drops every gradient and moment chunk and gives their arena memory back,
    then restores the sets whose master is on the device first, dropping each set's master right
    after its parameters are back (a model that fills memory has no room for its chunks and its
    restored tensors at once)."""
    model = GPT(GPT_PRESETS["tiny"])
    engine = gx.enable(model, _cfg("sim", precision="bf16", offload_optim_frac=0.5))
    opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
    x, y = synthetic_batch(model.cfg, 2, 16, 0, engine.compute_device)
    model(x, y).backward()
    opt.step()
    engine.synchronize()  # the CPU steps may still be running (direct reads need it)
    # bf16 training: close() gives back the fp32 masters' values
    expected = {n: engine.internal.runtime.read("param", engine.parameter_index(p)).clone() for n,
                p in model.named_parameters()}
    on_host = [p["optim_on_host"] for p in engine.internal.runtime.set_placements()]
    assert any(on_host) and not all(on_host)
    reserved_before = engine.internal.chunks.reserved_bytes("device")["current"]
    calls, reserved, device_bytes = [], [], []
    restorer = gx._engine.restore.ModelRestorer
    real_drop, real_trim = restorer.drop_set_state, restorer.trim_chunk_memory

    def drop(self, chunks, kinds):
        calls.append((self._layout.sets.index(chunks), kinds))
        real_drop(self, chunks, kinds)
        device_bytes.append(self._chunks.tier_bytes("device")["current"])

    def trim(self):
        real_trim(self)
        reserved.append(self._chunks.reserved_bytes("device")["current"])

    monkeypatch.setattr(restorer, "drop_set_state", drop)
    monkeypatch.setattr(restorer, "trim_chunk_memory", trim)
    engine.close()
    n = len(on_host)
    assert calls[:n] == [(s, ("grad", "exp_avg", "exp_avg_sq")) for s in range(n)], "state first, every set"
    masters = calls[n:]
    assert sorted(s for s, _ in masters) == list(range(n)) and all(k == ("master",) for _, k in masters)
    assert [on_host[s] for s, _ in masters] == sorted(on_host), "device-state sets first"
    assert len(reserved) == 1 and reserved[0] < reserved_before, "the moments' device memory went back"
    assert device_bytes == sorted(device_bytes, reverse=True) and device_bytes[n - 1] > device_bytes[-1]
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("offload_optim_frac", [1.0, 0.0], ids=["masters_on_host", "masters_on_device"])
def test_a_gpu_built_fp32_model_lands_in_bf16_chunks_exactly_as_torch_rounds_it(offload_optim_frac):
    """enable() writes a GPU-built fp32 model into bf16 parameter chunks on the host (converted on
    the device, then one copy) and into fp32 masters: the parameters read back exactly as
    .to(torch.bfloat16) of the originals, the masters exactly as the originals."""
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["tiny"]).cuda()
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = _cfg("cuda", precision="bf16", offload_optim_frac=offload_optim_frac)
    with gx.enable(model, cfg) as engine:
        for name, p in model.named_parameters():
            assert p.dtype == torch.bfloat16 and p.device.type == "cuda", name
            torch.testing.assert_close(p.detach(), expected[name].to(torch.bfloat16), rtol=0, atol=0, msg=name)
        masters = engine.state_dict()
        for name, value in expected.items():
            torch.testing.assert_close(masters[name], value.cpu(), rtol=0, atol=0, msg=name)


@pytest.mark.cuda
def test_close_parks_on_the_host_what_the_device_has_no_room_for():
    """With the device full (another tensor took what the chunks left free), close() cannot
    restore every parameter next to the chunks: those wait on the host until the chunks are
    freed, then go back to the GPU with their values."""
    engine, model, expected = close_on_a_nearly_full_device(64 << 20)
    assert engine._close_staged_params > 0, "the device had no room: some parameters waited on the host"
    for name, p in model.named_parameters():
        assert p.device.type == "cuda", name
        assert p.untyped_storage().nbytes() == p.numel() * 4, "an ordinary tensor, not a chunk view"
        torch.testing.assert_close(p.detach().cpu(), expected[name], rtol=0, atol=0)


@pytest.mark.cuda
def test_close_leaves_on_the_host_what_the_device_cannot_hold_even_without_chunks():
    """A model sharded because one GPU cannot hold it cannot come back whole onto one GPU at
    close: what does not fit once the chunks are freed stays on the host with its values, and a
    warning says so. Here a second filler takes the room the chunks gave back."""
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(16)]).cuda()  # 256 MiB fp32
    model.requires_grad_(False)
    expected = {n: p.detach().clone().cpu() for n, p in model.named_parameters()}
    engine = gx.enable(model, gx.GeminiConfig(device="cuda", precision="fp32", min_chunk_size_m=4, search_range_m=8))
    torch.cuda.empty_cache()
    fillers = [torch.empty(torch.cuda.mem_get_info()[0] - (64 << 20), dtype=torch.uint8, device="cuda")]
    move = engine._move_staged_params

    def fill_then_move(staged):
        torch.cuda.empty_cache()
        fillers.append(torch.empty(torch.cuda.mem_get_info()[0] - (16 << 20), dtype=torch.uint8, device="cuda"))
        while True:  # and the blocks torch still caches between live tensors (earlier tests'), weight-sized
            try:
                fillers.append(torch.empty(2048 * 2048, dtype=torch.float32, device="cuda"))
            except torch.OutOfMemoryError:
                break
        move(staged)

    engine._move_staged_params = fill_then_move
    try:
        with pytest.warns(UserWarning, match=r"parameters \(.*\) stay on the host.*save_checkpoint"):
            engine.close()
    finally:
        fillers.clear()
        torch.cuda.empty_cache()
    assert engine._close_params_left_on_host > 0
    on_host = [n for n, p in model.named_parameters() if p.device.type == "cpu"]
    assert len(on_host) == engine._close_params_left_on_host
    for name, p in model.named_parameters():
        assert p.untyped_storage().nbytes() == p.numel() * 4, "an ordinary tensor, not a chunk view"
        torch.testing.assert_close(p.detach().cpu(), expected[name], rtol=0, atol=0)


def test_a_model_no_rank_has_room_for_is_not_restored_and_both_enable_and_close_say_so(monkeypatch):
    """When the whole model cannot fit the device and host once the chunks are freed (a model
    sharded because nothing holds it whole), enable() warns while the values can still be saved
    and close() frees the chunks and leaves each parameter an empty tensor of its dtype and device."""
    monkeypatch.setattr(gx._engine.restore, "restore_free_bytes", lambda chunks, device, ranks_on_host: 1000)
    model = GPT(GPT_PRESETS["tiny"])
    model.register_buffer("scale", torch.ones(3, dtype=torch.float64))
    with pytest.warns(UserWarning, match=r"larger than this rank's device and host memory.*save_checkpoint"):
        engine = gx.enable(model, _cfg("sim"))
    with pytest.warns(UserWarning, match=r"does not fit .* left empty .*save_checkpoint"):
        engine.close()
    for name, p in model.named_parameters():
        assert p.numel() == 0 and p.dtype == torch.float32 and p.device.type == "cpu", name
    assert model.scale.dtype == torch.float64 and torch.equal(model.scale, torch.ones(3, dtype=torch.float64))
    assert gx._engine.registry.engine_of(model) is None and engine.closed


def test_existing_gradients_follow_their_parameters():
    model = torch.nn.Linear(4, 4)
    model(torch.randn(2, 4)).sum().backward()
    grad = model.weight.grad.clone()
    with gx.enable(model, _cfg("sim")) as engine:
        assert model.weight.grad is None, "it went into the gradient chunk"
        torch.testing.assert_close(engine.grad(model.weight), grad)
        model(torch.randn(2, 4)).sum().backward()  # and accumulates like p.grad would
        assert engine.grad(model.weight).abs().sum() > grad.abs().sum() * 0


def test_state_dict_is_fp32_on_cpu_with_plain_keys():
    model = GPT(GPT_PRESETS["tiny"])
    keys = set(model.state_dict())
    with gx.enable(model, _cfg("sim")) as engine:
        sd = engine.state_dict()
    assert set(sd) == keys
    assert all(v.device.type == "cpu" for v in sd.values())
    assert all(v.dtype == torch.float32 for v in sd.values() if v.is_floating_point())


def test_unsupported_optimizers_and_options_raise():
    model = torch.nn.Linear(4, 4)
    with gx.enable(model, _cfg("sim")) as engine:
        with pytest.raises(TypeError, match="is not a torch.optim.Optimizer class"):
            engine.optimizer(torch.nn.Linear, lr=0.1)
        with pytest.raises(ValueError, match="amsgrad"):
            engine.optimizer(torch.optim.Adam, amsgrad=True)
        with pytest.raises(RuntimeError, match="already managed"):
            gx.enable(model, _cfg("sim"))


def test_replica_groups_must_divide_the_world_size():
    with pytest.raises(ValueError, match="extra_dp_size=2.*divide the world size"):
        gx.enable(torch.nn.Linear(4, 4), _cfg("sim", extra_dp_size=2))


def test_overrides_and_bad_arguments():
    with gx.enable(torch.nn.Linear(4, 4), _cfg("sim"), sim_capacity="1MiB") as engine:
        assert engine.device_kind == "sim"
    with pytest.raises(TypeError, match="no field"):
        gx.enable(torch.nn.Linear(4, 4), _cfg("sim"), not_a_field=1)
    with pytest.raises(TypeError, match="nn.Module"):
        gx.enable("model")
    with pytest.raises(ValueError, match="no parameters"):
        gx.enable(torch.nn.ReLU(), _cfg("sim"))


def test_model_larger_than_the_sim_device_fails_clearly():
    with pytest.raises(gx.OutOfMemoryError, match="sim_capacity"):
        gx.enable(torch.nn.Linear(512, 512), _cfg("sim", sim_capacity=64 * 1024))


def test_running_out_of_memory_inside_the_block_notes_where_memory_stood():
    """An out-of-memory error raised in the `with` block (here the host tier's) leaves with the
    chunks' share of device and host memory beside the process's resident memory and the host's
    MemAvailable, so that a plan that missed something shows it."""
    with pytest.raises(gx.OutOfMemoryError, match="raised by the test") as err:
        with gx.enable(torch.nn.Linear(64, 64), _cfg("sim")) as engine:
            pool = engine.internal.chunks.pool_stats(engine.internal.chunks.host_tier)
            device = engine.internal.chunks.tier_bytes("device")["current"]
            raise gx.OutOfMemoryError("pageable_host out of memory (raised by the test)")
    note = "\n".join(err.value.__notes__)
    assert f"chunks on the device {gx.format_bytes(device)}" in note, note
    assert f"{gx.format_bytes(pool['in_use_bytes']['current'])} in use" in note, note
    assert "resident memory" in note and "MemAvailable" in note, note
    assert engine.internal.closed, "the engine still closed"


def test_cuda_requested_without_cuda_is_refused():
    if gx._C.build_info()["cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="device='sim'"):
        gx.enable(torch.nn.Linear(4, 4), _cfg("cuda"))


def test_a_model_smaller_than_the_minimum_chunk_gets_one_chunk_of_its_size():
    model = torch.nn.Linear(100, 100)  # 10,100 elements, far below min_chunk_size_m=32 (32 Mi elements)
    with gx.enable(model, device="sim") as engine:
        stats = engine.stats()
    assert stats["num_param_chunks"] == 1
    assert engine.chunk_size < 11_000, "no 32 Mi-element chunks for a 10 k-element model"
