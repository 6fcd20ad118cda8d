"""`GeminiStrategy`: a `lightning.pytorch` strategy training the LightningModule under a gemini_ext engine.

[Note: what Lightning hands to the engine]
`Trainer(strategy=GeminiStrategy(gx.GeminiConfig(...)), precision=...)` keeps Lightning's loops,
logging, callbacks and launcher (several processes: the engine shards over Lightning's process
group); the strategy gives the engine what concerns the parameters:
- `setup` enables the engine on the LightningModule (it is never moved to the device whole nor
  wrapped in DistributedDataParallel) and wraps the optimizer `configure_optimizers` returns, a
  supported class's instance over `self.parameters()`, in `gx.GeminiOptimizer` (its param groups
  stay shared, so Lightning's LR schedulers drive it);
- `precision` ("32-true", "bf16-mixed" / "bf16-true", "16-mixed" / "16-true") chooses the
  engine's precision and Lightning's own autocast is off; a config asking for another precision
  is an error;
- `gradient_clip_val` (by norm) clips through the engine (torch's clip_grad_norm_ over every
  parameter is routed there); `accumulate_grad_batches` runs the micro-batches before the last
  under `no_sync()` when sharded (in one process gradients accumulate through their host copies);
- checkpoints: beside Lightning's file (model state from the masters, loops, callbacks), the
  engine's own checkpoint in `<file>.gemini/`; `ckpt_path=` restores from it after set-up
  (masters, optimizer state, RNG), so training resumes bit-exactly;
- `teardown` closes the engine: after `fit` the module holds the trained values as ordinary
  parameters.
Importing this module registers the strategy under names in Lightning's StrategyRegistry, so that
`Trainer(strategy="gemini")` works: STRATEGY_NAMES lists each name with the config it stands for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

from ..config import GeminiConfig
from ..engine import enable
from ..optim import GeminiOptimizer
from ._precision import agreed_precision

ENGINE_SUFFIX = ".gemini"  # the engine's checkpoint beside Lightning's checkpoint file
# The names `Trainer(strategy=...)` accepts, with the config each stands for and its description.
STRATEGY_NAMES = {
    "gemini": ({}, "gemini_ext: the default GeminiConfig (static placement, optimizer state on the host)"),
    "gemini_auto": ({"placement_policy": "auto"},
                    "gemini_ext: auto placement (measured; as much as fits stays on the device)"),
    "gemini_offload": ({"offload_optim_frac": 1.0, "offload_param_frac": 1.0},
                       "gemini_ext: parameters and optimizer state homed on the host"),
}
PRECISIONS = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16",
              "16-true": "fp16"}


def register_strategy_names(strategy_registry, strategy_cls) -> None:
    """STRATEGY_NAMES in a Lightning or Fabric strategy registry, each building `strategy_cls` with
    its config; names already there are left as they are."""
    for name, (fields, description) in STRATEGY_NAMES.items():
        if name not in strategy_registry:
            strategy_registry.register(name, strategy_cls, description=description, config=GeminiConfig(**fields))


def engine_precision(lightning_precision: str, config: GeminiConfig) -> str:
    """The engine precision for the Trainer's `precision`; a config whose precision is not the
    default and differs is a conflict."""
    wanted = PRECISIONS.get(str(lightning_precision))
    if wanted is None:
        raise ValueError(f"GeminiStrategy: precision={lightning_precision!r}; the engine trains with "
                         f"{sorted(PRECISIONS)}.")
    return agreed_precision(config, wanted, "GeminiStrategy", f"Trainer(precision={lightning_precision!r})")


class GeminiStrategy(DDPStrategy):
    strategy_name = "gemini"

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """Registers STRATEGY_NAMES (DDPStrategy's own names stay DDP's)."""
        register_strategy_names(strategy_registry, cls)

    def __init__(self, config: GeminiConfig | None = None, **ddp_kwargs):
        super().__init__(**ddp_kwargs)
        self.config = config if config is not None else GeminiConfig()
        self.engine = None
        self._restore_from = None

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # ckpt_path is loaded into the engine, which exists from setup() on

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        module = self.lightning_module
        precision = engine_precision(trainer.precision, self.config)
        self.precision_plugin = Precision()  # the engine computes in its precision: no autocast on top
        if self.engine is None or self.engine.closed:
            self.engine = enable(module, dataclasses.replace(self.config, precision=precision))
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(f"GeminiStrategy: configure_optimizers returned {len(self.optimizers)} optimizers; "
                                 "the engine steps one. Return one optimizer over self.parameters().")
            opt = self.optimizers[0]
            self.optimizers = [opt if isinstance(opt, GeminiOptimizer) else GeminiOptimizer(opt, module)]
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        pass  # the engine placed the parameters (in chunks) and the buffers

    @contextlib.contextmanager
    def block_backward_sync(self):
        if self.engine is not None and not self.engine.closed and self.engine.world_size > 1:
            with self.engine.no_sync():
                yield
        else:
            yield

    # --- checkpoints ---------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict:
        return self.engine.state_dict()  # collective when sharded: every rank calls it

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        self.engine.save_checkpoint(os.fspath(filepath) + ENGINE_SUFFIX)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath) -> None:
        super().remove_checkpoint(filepath)
        engine_dir = os.fspath(filepath) + ENGINE_SUFFIX
        if self.is_global_zero and os.path.isdir(engine_dir):
            shutil.rmtree(engine_dir)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        self._restore_from = os.fspath(checkpoint_path) + ENGINE_SUFFIX
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if self._restore_from is None or not os.path.isdir(self._restore_from):
            raise ValueError(f"GeminiStrategy: no engine checkpoint at {self._restore_from}; resume from a checkpoint "
                             "a GeminiStrategy saved.")
        self.engine.load_checkpoint(self._restore_from)  # masters, optimizer state, steps, RNG

    def teardown(self) -> None:
        if self.engine is not None and not self.engine.closed:
            self.engine.close()  # the module holds the trained values as ordinary parameters
        super().teardown()


GeminiStrategy.register_strategies(StrategyRegistry)
