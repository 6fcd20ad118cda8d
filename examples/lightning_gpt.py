"""The example GPT trained by a Lightning Trainer with gemini_ext's strategy.

    python examples/lightning_gpt.py                    # gpt-tiny, 200 steps, on the GPU if there is one
    python examples/lightning_gpt.py --preset 125m --steps 50
    python examples/lightning_gpt.py --devices 2        # two processes; Lightning starts the second

The LightningModule is ordinary: `configure_optimizers` returns torch's AdamW over
`self.parameters()` and a scheduler; `GeminiStrategy` wraps the optimizer, places the parameters
in chunks and gives the trained values back when `fit` ends. Several processes: `--devices N`
(Lightning's launcher runs this script again for each further rank) or torchrun, as with
Lightning's DDP; the chunks are then sharded over the ranks.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch

import gemini_ext as gx
from gemini_ext.integrations.lightning import GeminiStrategy
from gemini_ext.models import GPT, GPT_PRESETS, synthetic_batch


class GPTModule(pl.LightningModule):
    def __init__(self, preset: str, lr: float):
        super().__init__()
        self.cfg = GPT_PRESETS[preset]
        self.lr = lr
        self.gpt = GPT(self.cfg)
        self.losses = []

    def training_step(self, batch, _):
        x, y = batch
        loss = self.gpt(x[0], y[0])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, self.trainer.max_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Batches(torch.utils.data.Dataset):
    def __init__(self, cfg, n: int, batch: int, seq: int):
        self.cfg, self.n, self.batch, self.seq = cfg, n, batch, seq

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return synthetic_batch(self.cfg, self.batch, self.seq, i, torch.device("cpu"))


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(GPT_PRESETS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "sim"])
    p.add_argument("--devices", type=int, default=1, help="processes (one GPU each on cuda)")
    args = p.parse_args(argv)
    device = gx.resolve_device(gx.GeminiConfig(device=args.device))
    cuda = device == "cuda"
    torch.manual_seed(0)
    module = GPTModule(args.preset, lr=1e-3)
    strategy = GeminiStrategy(gx.GeminiConfig(device=device, placement_policy="auto"))
    trainer = pl.Trainer(strategy=strategy, accelerator="gpu" if cuda else "cpu", devices=args.devices,
                         precision="bf16-mixed" if cuda else "32-true", max_steps=args.steps, gradient_clip_val=1.0,
                         accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    seq = min(args.seq, module.cfg.max_seq_len)
    batches = Batches(module.cfg, args.steps * 2, args.batch, seq)
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=1,
                                                    collate_fn=lambda items: tuple(t[None] for t in items[0])))
    if trainer.global_rank != 0:
        return module.losses
    print(f"gpt-{args.preset}: loss {module.losses[0]:.3f} -> {module.losses[-1]:.3f} over {args.steps} steps "
          f"({strategy.engine.stats()['optimizer_steps']} optimizer steps under gemini_ext)")
    return module.losses


if __name__ == "__main__":
    main()
