"""GeminiStrategy against Lightning's default strategy: the small GPT, fp32, 20 optimizer steps
with gradient_clip_val, accumulate_grad_batches=2, an LR schedule and a budget that evicts;
bit-exact resume from ckpt_path."""

import pytest
import torch

import gemini_ext as gx
from parity_utils import SMALL, batch, max_relative_difference
from gemini_ext.models import GPT

pl = pytest.importorskip("lightning.pytorch")
from gemini_ext.integrations.lightning import GeminiStrategy  # noqa: E402

STEPS, ACCUM = 20, 2


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


def _fit(module, strategy, root, max_steps=STEPS, ckpt_path=None, callbacks=(), batches=STEPS * ACCUM):
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, precision="32-true", max_steps=max_steps,
                         gradient_clip_val=0.05, accumulate_grad_batches=ACCUM, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                         enable_checkpointing=bool(callbacks), default_root_dir=str(root), num_sanity_val_steps=0,
                         # a distributed strategy (as DDP's) injects a DistributedSampler; the default
                         # single-device one does not: the same batches in the same order on both sides
                         use_distributed_sampler=False)
    loader = torch.utils.data.DataLoader(Batches(batches), batch_size=1, shuffle=False)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


def _config():
    # the small GPT in chunks of 4096 elements, room for 8 of them on the device: evictions every step
    return gx.GeminiConfig(device="sim", precision="fp32", chunk_config_dict={"chunk_size": 4096},
                           sim_capacity=8 * 4096 * 4)


def test_strategy_matches_the_default_strategy(tmp_path):
    reference = GPTModule()
    _fit(reference, "auto", tmp_path / "plain")
    module = GPTModule()
    strategy = GeminiStrategy(_config())
    _fit(module, strategy, tmp_path / "gx")
    assert strategy.engine.closed, "teardown gave the module back"
    assert strategy.engine.stats()["counters"]["evictions"] > 0
    assert strategy.engine.stats()["optimizer_steps"] == STEPS
    assert max(max_relative_difference(module, reference).values()) <= 1e-5


def _fit_then_resume(strategy_factory, root):
    """4 steps with a checkpoint at the end of the epoch, then a new Trainer resuming from it to 8."""
    epoch = 4 * ACCUM
    saver = pl.callbacks.ModelCheckpoint(dirpath=str(root / "ckpts"), every_n_epochs=1, save_top_k=-1)
    _fit(GPTModule(), strategy_factory(), root / "first", max_steps=4, callbacks=[saver], batches=epoch)
    ckpt = next((root / "ckpts").glob("*step=4*.ckpt"))
    resumed = GPTModule()
    _fit(resumed, strategy_factory(), root / "resumed", max_steps=8, ckpt_path=str(ckpt), batches=epoch)
    return resumed, ckpt


def test_resume_from_ckpt_path_continues_as_the_default_strategy_does(tmp_path):
    """Lightning's own resume semantics (where a resumed epoch's batches start) apply to both sides."""
    reference, _ = _fit_then_resume(lambda: "auto", tmp_path / "plain")
    resumed, ckpt = _fit_then_resume(lambda: GeminiStrategy(_config()), tmp_path / "gx")
    assert (ckpt.parent / (ckpt.name + ".gemini") / "index.json").is_file(), "the engine's checkpoint beside"
    assert max(max_relative_difference(resumed, reference).values()) <= 1e-5


def test_conflicting_precision_is_refused(tmp_path):
    strategy = GeminiStrategy(gx.GeminiConfig(device="sim", precision="fp32"))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=1,
                         logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match="bf16.*precision='fp32'"):
        trainer.fit(GPTModule(), torch.utils.data.DataLoader(Batches(2), batch_size=1))
