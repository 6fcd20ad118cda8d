"""GeminiStrategy against Lightning's default strategy: the small GPT, fp32, 20 optimizer steps
with gradient_clip_val, accumulate_grad_batches=2, an LR schedule and a budget that evicts;
bit-exact resume from ckpt_path."""

import json
import os

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES, run_python
from dist_utils import free_port
from parity_utils import SMALL, batch, chunk_cap, max_relative_difference
from gemini_ext.models import GPT

pl = pytest.importorskip("lightning.pytorch")
from gemini_ext.integrations.lightning import GeminiStrategy  # noqa: E402

STEPS, ACCUM = 20, 2
HERE = os.path.dirname(os.path.abspath(__file__))


class Batches(torch.utils.data.Dataset):
    def __init__(self, n=STEPS * ACCUM):
        self.items = [batch(SMALL, k, torch.device("cpu")) for k in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class GPTModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT(SMALL)

    def training_step(self, data, _):
        x, y = data
        return self.gpt(x[0], y[0])

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit(module, strategy, root, max_steps=STEPS, ckpt_path=None, callbacks=(), batches=STEPS * ACCUM, devices=1,
         device="sim", clip=0.05):
    trainer = pl.Trainer(strategy=strategy, accelerator="gpu" if device == "cuda" else "cpu", devices=devices,
                         precision="32-true", max_steps=max_steps,
                         gradient_clip_val=clip or None, accumulate_grad_batches=ACCUM, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                         enable_checkpointing=bool(callbacks), default_root_dir=str(root), num_sanity_val_steps=0,
                         # in one process a distributed strategy (as DDP's) injects a DistributedSampler and
                         # the default single-device one does not: the same batches in the same order on both sides
                         use_distributed_sampler=devices > 1)
    loader = torch.utils.data.DataLoader(Batches(batches), batch_size=1, shuffle=False)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


def _config(device="sim", **kw):
    # the small GPT in chunks of 4096 elements, room for 8 of them on the device: evictions every step
    if "sim_capacity" not in kw:
        kw.update(chunk_cap(device, 8 * 4096 * 4))
    return gx.GeminiConfig(device=device, precision="fp32", chunk_config_dict={"chunk_size": 4096}, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_strategy_matches_the_default_strategy(tmp_path, device):
    reference = GPTModule()
    _fit(reference, "auto", tmp_path / "plain", device=device)
    module = GPTModule()
    strategy = GeminiStrategy(_config(device))
    _fit(module, strategy, tmp_path / "gx", device=device)
    assert strategy.engine.closed, "teardown gave the module back"
    assert strategy.engine.stats()["counters"]["evictions"] > 0
    assert strategy.engine.stats()["optimizer_steps"] == STEPS
    assert max(max_relative_difference(module, reference).values()) <= 1e-5


def test_the_step_in_backward_with_accumulate_grad_batches_is_exact(tmp_path):
    """optimizer_step_in_backward in one process: Lightning's micro-batches before the last run
    under no_sync(), and the result equals the step from step() bit for bit (no clipping)."""
    modules = []
    for in_backward in (False, True):
        module = GPTModule()
        _fit(module, GeminiStrategy(_config(optimizer_step_in_backward=in_backward)), tmp_path / str(in_backward),
             max_steps=6, clip=0.0)
        modules.append(module)
    for (name, a), (_, b) in zip(modules[0].named_parameters(), modules[1].named_parameters()):
        assert torch.equal(a, b), name


def _fit_then_resume(strategy_factory, root, devices=1, device="sim"):
    """4 steps with a checkpoint at the end of the epoch, then a new Trainer resuming from it to 8.
    Returns the module after the first 4 steps, the resumed one, and the checkpoint's path."""
    epoch = 4 * ACCUM * devices
    saver = pl.callbacks.ModelCheckpoint(dirpath=str(root / "ckpts"), every_n_epochs=1, save_top_k=-1)
    first = GPTModule()
    _fit(first, strategy_factory(), root / "first", max_steps=4, callbacks=[saver], batches=epoch, devices=devices,
         device=device)
    ckpt = next((root / "ckpts").glob("*step=4*.ckpt"))
    resumed = GPTModule()
    _fit(resumed, strategy_factory(), root / "resumed", max_steps=8, ckpt_path=str(ckpt), batches=epoch,
         devices=devices, device=device)
    return first, resumed, ckpt


@pytest.mark.parametrize("device", DEVICES)
def test_resume_from_ckpt_path_continues_as_the_default_strategy_does(tmp_path, device):
    """Lightning's own resume semantics (where a resumed epoch's batches start) apply to both sides."""
    _, reference, _ = _fit_then_resume(lambda: "auto", tmp_path / "plain", device=device)
    first, resumed, ckpt = _fit_then_resume(lambda: GeminiStrategy(_config(device)), tmp_path / "gx", device=device)
    assert (ckpt.parent / (ckpt.name + ".gemini") / "index.json").is_file(), "the engine's checkpoint beside"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    # no second copy of the model or optimizer in Lightning's file: the engine's shards are the state
    assert saved["state_dict"] == {} and saved["optimizer_states"] == [{}], (saved["state_dict"].keys(),)
    assert saved["gemini_ext"]["engine_checkpoint"] == ckpt.name + ".gemini"
    model_bytes = 4 * sum(p.numel() for p in resumed.parameters())
    assert ckpt.stat().st_size < model_bytes / 4, (ckpt.stat().st_size, model_bytes)
    assert max(max_relative_difference(resumed, reference).values()) <= 1e-5
    # validation from the checkpoint loads the model alone (no optimizer exists outside fit)
    evaluated = GPTModule()
    evaluated.validation_step = lambda data, *_: evaluated.log("val_loss", evaluated.training_step(data, 0))
    trainer = pl.Trainer(strategy=GeminiStrategy(_config(device)), accelerator="gpu" if device == "cuda" else "cpu",
                         devices=1, precision="32-true", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path / "eval"))
    trainer.validate(evaluated, torch.utils.data.DataLoader(Batches(2), batch_size=1), ckpt_path=str(ckpt))
    assert max(max_relative_difference(evaluated, first).values()) == 0.0, "the values the checkpoint saved"


class ConfiguredGPTModule(GPTModule):
    """The GPT built in configure_model (as for a model too large to build whole), optionally
    starting from given values."""

    def __init__(self, initial=None):
        pl.LightningModule.__init__(self)
        self.initial, self.built_on = initial, None

    def configure_model(self):
        if hasattr(self, "gpt"):
            return
        self.gpt = GPT(SMALL)
        self.built_on = next(self.gpt.parameters()).device.type
        if self.initial is not None:
            self.gpt.load_state_dict(self.initial)


class InitialValues(pl.Callback):
    def on_train_start(self, trainer, module):
        self.values = {k.removeprefix("gpt."): v.clone() for k, v in trainer.strategy.engine.state_dict().items()}


@pytest.mark.parametrize("device", DEVICES)
def test_configure_model_builds_on_meta_and_trains_as_the_default_strategy(tmp_path, device):
    """configure_model runs on the meta device under GeminiStrategy; the engine gives each module
    storage and its initial values at set-up; from those values training matches Lightning's
    default strategy with the model built on the CPU."""
    module, initial = ConfiguredGPTModule(), InitialValues()
    _fit(module, GeminiStrategy(_config(device)), tmp_path / "gx", max_steps=6, batches=6 * ACCUM,
         callbacks=[initial], device=device)
    assert module.built_on == "meta"
    assert all(v.abs().sum() > 0 for k, v in initial.values.items() if k.endswith("weight")), "initialised"
    reference = ConfiguredGPTModule(initial.values)
    _fit(reference, "auto", tmp_path / "plain", max_steps=6, batches=6 * ACCUM, device=device)
    assert reference.built_on == ("cuda" if device == "cuda" else "cpu")
    assert max(max_relative_difference(module, reference).values()) <= 1e-5


def test_two_processes_through_lightnings_launcher(tmp_path):
    """`devices=2`: Lightning's launcher starts the second process by running the script again (as
    it does for a user's script). Both strategies fit and resume there; the engine shards over
    Lightning's gloo group; rank 0 reports how far GeminiStrategy is from DDP."""
    # Lightning leaves LOCAL_RANK, NODE_RANK and the address of a one-process fit's (still open)
    # group in os.environ; with LOCAL_RANK set, a script's launcher takes its processes as started
    env = {"OMP_NUM_THREADS": "1", "LOCAL_RANK": None, "NODE_RANK": None, "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    out = run_python(os.path.join(HERE, "workers", "lightning_ddp_worker.py"), str(tmp_path), env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["world_size"] == 2 and report["engine_world_size"] == 2, report
    assert report["ranks_on_host"] == 2, "Lightning's launcher sets no LOCAL_WORLD_SIZE: counted from the group"
    assert report["engine_files"] >= 2, "each rank wrote its shard of the engine's checkpoint"
    for phase in ("first", "resumed"):
        assert report[phase] <= 5e-5, report  # a per-rank mean of means: another summation order (test_distributed)


def test_conflicting_precision_is_refused(tmp_path):
    strategy = GeminiStrategy(gx.GeminiConfig(device="sim", precision="fp32"))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=1,
                         logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match="bf16.*precision='fp32'"):
        trainer.fit(GPTModule(), torch.utils.data.DataLoader(Batches(2), batch_size=1))


@pytest.mark.parametrize("name, policy, param_frac", [("gemini", "static", 0.0), ("gemini_auto", "auto", 0.0),
                                                      ("gemini_offload", "static", 1.0)])
def test_strategy_names_select_the_strategy_from_lightnings_registry(tmp_path, name, policy, param_frac):
    from lightning.pytorch.strategies import StrategyRegistry
    assert name in StrategyRegistry, sorted(StrategyRegistry)
    module = GPTModule()
    trainer = _fit(module, name, tmp_path, max_steps=2, batches=2 * ACCUM)
    strategy = trainer.strategy
    assert isinstance(strategy, GeminiStrategy)
    assert (strategy.config.placement_policy, strategy.config.offload_param_frac) == (policy, param_frac)
    assert strategy.engine.closed and strategy.engine.stats()["optimizer_steps"] == 2


def test_save_checkpoint_after_fit_writes_the_trained_model_as_the_default_strategy_does(tmp_path):
    """After fit, teardown closed the engine: trainer.save_checkpoint() writes the module's ordinary
    state dict (no optimizer state, said in a warning); validate(ckpt_path=) loads it and
    fit(ckpt_path=) refuses it, naming the fix."""
    module = GPTModule()
    trainer = _fit(module, GeminiStrategy(_config()), tmp_path / "fit", max_steps=2, batches=2 * ACCUM)
    path = tmp_path / "final.ckpt"
    with pytest.warns(UserWarning, match="no optimizer state"):
        trainer.save_checkpoint(path)
    saved = torch.load(path, map_location="cpu", weights_only=False)
    trained = module.state_dict()
    assert saved["state_dict"].keys() == trained.keys()
    assert all(torch.equal(saved["state_dict"][k], trained[k]) for k in trained)
    evaluated = GPTModule()
    evaluated.validation_step = lambda data, *_: evaluated.log("val_loss", evaluated.training_step(data, 0))
    pl.Trainer(strategy=GeminiStrategy(_config()), accelerator="cpu", devices=1, precision="32-true", logger=False,
               enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path / "eval")
               ).validate(evaluated, torch.utils.data.DataLoader(Batches(2), batch_size=1), ckpt_path=str(path))
    assert max(max_relative_difference(evaluated, module).values()) == 0.0
    with pytest.raises(ValueError, match="saved after fit ended.*ModelCheckpoint"):
        _fit(GPTModule(), GeminiStrategy(_config()), tmp_path / "resume", max_steps=4, ckpt_path=str(path))
