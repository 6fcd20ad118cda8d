"""Models built on the meta device: enable() gives each module storage as it reaches it, runs the
initialiser, and the model trains as if it had been built on the device (gemini_ext/_engine/materialize.py)."""

import pytest
import torch

import gemini_ext as gx
from dist_utils import run_ranks, run_torchrun
from gemini_ext.models import GPT
from parity_utils import (SMALL, batch, config, max_relative_difference, torch_device, train_gemini,
                          train_reference)
from test_distributed import GLOBAL_BATCH, PARAM_TOLERANCE, STEPS, _train_sharded


def _meta_gpt(cfg=SMALL) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


def _initialised_gpt(seed: int, device: str = "cpu", cfg=SMALL) -> GPT:
    """The values a meta-built GPT must get from init_weights after torch.manual_seed(seed)."""
    with torch.device(device):
        model = GPT(cfg)
    torch.manual_seed(seed)
    model.apply(model.init_weights)
    return model


@pytest.mark.parametrize("device", ["sim", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_meta_built_gpt_gets_the_values_of_its_initialiser_and_trains_like_one_built_on_the_device(device):
    reference = _initialised_gpt(seed=3, device=torch_device(device).type)
    model = _meta_gpt()
    torch.manual_seed(3)
    with gx.enable(model, config(device), param_init_fn=model.init_weights) as engine:
        state = engine.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(state[key], value.cpu()), key
    assert model.head.weight is model.tok_emb.weight, "the tie survives materialisation"
    for name, p in model.named_parameters():
        assert not p.is_meta and p.device.type == torch_device(device).type, (name, p.device)

    model = _meta_gpt()  # and it trains like the model built on the device
    torch.manual_seed(3)
    losses, _ = train_gemini(model, 3, config(device), lr=1e-3, weight_decay=0.1, param_init_fn=model.init_weights)
    ref_losses = train_reference(reference, 3, torch_device(device), lr=1e-3, weight_decay=0.1)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


def test_by_default_each_module_is_reset_by_its_own_reset_parameters():
    """torch's layers construct themselves with reset_parameters(): from the same seed, a meta
    build initialised by enable() equals one built on the CPU."""
    def build():
        return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LayerNorm(96), torch.nn.GELU(),
                                   torch.nn.Linear(96, 32), torch.nn.Embedding(10, 32))

    torch.manual_seed(7)
    reference = build()
    with torch.device("meta"):
        model = build()
    torch.manual_seed(7)
    with gx.enable(model, config("sim")) as engine:
        state = engine.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(state[key], value), key


def test_only_the_modules_being_written_hold_whole_tensors():
    """Each module gets storage when enable() reaches its first parameter and gives it up once
    its values are in chunks: when a layer is initialised, earlier layers are released and later
    ones are still on the meta device."""
    layers = 8
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(layers)])
    seen = []

    def init(module):
        module.reset_parameters()
        index = list(model).index(module)
        seen.append([("released" if p.numel() == 0 else "meta" if p.is_meta else "whole")
                     for layer in model for p in (layer.weight,)])
        assert seen[-1][index] == "whole"

    with gx.enable(model, config("sim"), param_init_fn=init):
        pass
    assert len(seen) == layers
    for k, states in enumerate(seen):
        assert states == ["released"] * k + ["whole"] + ["meta"] * (layers - k - 1), (k, states)


class _Scaled(torch.nn.Module):
    """A module with a parameter of its own and a buffer, and no reset_parameters()."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(16))
        self.register_buffer("offset", torch.full((16,), 0.5))

    def forward(self, x):
        return x * self.scale + self.offset


def test_a_module_without_reset_parameters_needs_an_initialiser_and_nothing_is_touched_before():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), _Scaled())
    with pytest.raises(ValueError, match=r"meta device.*1 module\(s\).*1 \(_Scaled\).*param_init_fn"):
        gx.enable(model, config("sim"))
    assert all(p.is_meta for p in model.parameters()), "the error came before any module got storage"

    def init(module):
        if isinstance(module, _Scaled):
            module.scale.fill_(2.0)
            module.offset.fill_(0.25)
        else:
            module.reset_parameters()

    with gx.enable(model, config("sim"), param_init_fn=init) as engine:
        assert torch.equal(engine.state_dict()["1.scale"], torch.full((16,), 2.0))
        assert torch.equal(model[1].offset, torch.full((16,), 0.25)), "buffers are the initialiser's too"
        out = model(torch.ones(2, 16))
        assert out.shape == (2, 16) and torch.isfinite(out).all()


def test_a_module_with_meta_buffers_only_is_initialised_too():
    class Table(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.zeros(8))

        def reset_parameters(self):
            self.table.copy_(torch.arange(8.0))

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), Table())
    with gx.enable(model, config("sim")):
        assert torch.equal(model[1].table, torch.arange(8.0))
    assert torch.equal(model[1].table, torch.arange(8.0)) and not model[1].table.is_meta


def test_an_initialiser_that_replaces_tensors_is_refused():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8))

    def replace(module):
        with torch.device("meta"):
            module.weight = torch.nn.Parameter(torch.empty(8, 8))

    with pytest.raises(RuntimeError, match=r"param_init_fn left 0\.weight on the meta device.*in place"):
        gx.enable(model, config("sim"), param_init_fn=replace)


def test_a_failure_after_materialising_says_the_model_must_be_built_again(monkeypatch):
    def fail(self, *args, **kwargs):
        raise RuntimeError("injected failure after the chunks were filled")

    monkeypatch.setattr(gx._engine.build, "_start_runtime", fail)
    model = _meta_gpt()
    with pytest.raises(RuntimeError, match="injected") as info:
        gx.enable(model, config("sim"), param_init_fn=model.init_weights)
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "built on the meta device" in note and "Build the model again" in note, note


def test_without_masters_the_materialised_fp32_values_are_released_and_a_failure_puts_them_back_on_meta(monkeypatch):
    """Under the 8-byte state a chunk holds only the bf16 rounding of an fp32 parameter; one that
    enable() materialised from meta holds the initialiser's values only, so it is released all the
    same (a 25B model's fp32 values would not fit beside its chunks), and a failure leaves it on meta."""
    def fail(self, *args, **kwargs):
        raise RuntimeError("injected failure after the chunks were filled")

    monkeypatch.setattr(gx._engine.build, "_start_runtime", fail)
    model = _meta_gpt()
    shapes = {name: p.shape for name, p in model.named_parameters()}
    cfg = config("sim", precision="bf16", optimizer_state_dtype="bf16", master_weights=False)
    with pytest.raises(RuntimeError, match="injected"):
        gx.enable(model, cfg, param_init_fn=model.init_weights)
    for name, p in model.named_parameters():
        assert p.is_meta and p.shape == shapes[name] and p.dtype == torch.float32, (name, p.device, p.shape)


def _sharded_meta_body(rank, world_size, device="sim"):
    """Each rank seeds differently: rank 0's initial values are the model's (as for a model built
    on a real device), and two ranks train it like one process on the global batch (accumulated
    over the ranks' slices: on an AVX2 EPYC, one backward over the whole batch left 6.4e-5 between
    the runs in one weight, Adam lifting fp32 rounding; the slices leave 6e-7)."""
    reference = _initialised_gpt(seed=0, device=torch_device(device).type)
    ref_losses = train_reference(reference, STEPS, torch_device(device), batch_size=GLOBAL_BATCH, slices=world_size)
    model = _meta_gpt()
    torch.manual_seed(rank)
    losses, _, _ = _train_sharded(model, config(device), rank, world_size, param_init_fn=model.init_weights)
    assert losses == pytest.approx(ref_losses, rel=1e-5), (losses, ref_losses)
    diffs = max_relative_difference(model, reference)
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= PARAM_TOLERANCE, f"rank {rank}: {worst}: {diffs[worst]:.3g} relative"


def test_two_ranks_train_a_meta_built_model_from_rank_zeros_values():
    run_ranks(2, _sharded_meta_body)


@pytest.mark.cuda
@pytest.mark.multigpu
def test_two_gpus_over_nccl_train_a_meta_built_model_from_rank_zeros_values(tmp_path):
    run_torchrun(2, _sharded_meta_body, "cuda", backend="nccl", tmp_dir=str(tmp_path))


def test_a_checkpoint_loads_into_a_meta_built_model(tmp_path):
    """The way back for a model close() cannot restore: save inside the block, build the model
    on the meta device again, enable it and load the checkpoint."""
    torch.manual_seed(0)
    model = GPT(SMALL)
    with gx.enable(model, config("sim")) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        x, y = batch(model.cfg, 0, engine.compute_device)
        model(x, y).backward()
        opt.step()
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        trained = engine.state_dict()
    again = _meta_gpt()
    with gx.enable(again, config("sim"), param_init_fn=again.init_weights) as engine:
        engine.optimizer(torch.optim.AdamW, lr=1e-3)
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        loaded = engine.state_dict()
    for key, value in trained.items():
        assert torch.equal(loaded[key], value), key
