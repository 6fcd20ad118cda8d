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
  under `no_sync()` when sharded or stepping in backward (otherwise, in one process, gradients
  accumulate through their host copies);
- modules built in `configure_model` (or under `Trainer.init_module()`) are built on the meta
  device: shapes only, and `setup` gives each module storage as the engine reaches it, running
  `param_init_fn(module)` (default: the module's own `reset_parameters()`), so the model is never
  whole in memory before its chunks exist (docs/USAGE.md, "Models larger than the host");
- checkpoints: the engine's shards are the state. Lightning's file keeps the loops, callbacks,
  schedulers and a pointer (`checkpoint["gemini_ext"]`), with an empty `state_dict` and empty
  optimizer states; the model and optimizer are in the engine's own checkpoint in
  `<file>.gemini/`, each rank writing its shard. `ckpt_path=` restores from it after set-up
  (masters, optimizer state, RNG), so training resumes bit-exactly; `validate`/`test`/`predict`
  with `ckpt_path=` load the model only. `gemini-ext export <file>.gemini OUT` gives a plain
  model;
- `teardown` closes the engine: after `fit` the module holds the trained values as ordinary
  parameters, and `trainer.save_checkpoint()` then writes the default strategy's file with the
  model in `state_dict` and no optimizer state (with a warning); `validate`/`test`/`predict` load
  it, `fit(ckpt_path=)` refuses it.
Importing this module registers the strategy under names in Lightning's StrategyRegistry, so that
`Trainer(strategy="gemini")` works: STRATEGY_NAMES lists each name with the config it stands for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import warnings

import torch

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

from .._native import _C
from ..config import GeminiConfig
from ..engine import enable
from ..optim import GeminiOptimizer
from ._precision import agreed_precision

ENGINE_SUFFIX = ".gemini"  # the engine's checkpoint beside Lightning's checkpoint file
CHECKPOINT_KEY = "gemini_ext"  # in Lightning's checkpoint: where the engine's checkpoint is
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

    def __init__(self, config: GeminiConfig | None = None, param_init_fn=None, **ddp_kwargs):
        super().__init__(**ddp_kwargs)
        self.config = config if config is not None else GeminiConfig()
        self.param_init_fn = param_init_fn  # for modules built on meta (configure_model)
        self.engine = None
        self._restore_from = None
        self._restored = False

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # ckpt_path is loaded into the engine, which exists from setup() on

    def setup(self, trainer) -> None:
        # see [Note: what Lightning hands to the engine]
        self.accelerator.setup(trainer)
        module = self.lightning_module
        precision = engine_precision(trainer.precision, self.config)
        self.precision_plugin = Precision()  # the engine computes in its precision: no autocast on top
        if self.engine is None or self.engine.closed:
            self.engine = enable(module, dataclasses.replace(self.config, precision=precision),
                                 param_init_fn=self.param_init_fn)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(f"GeminiStrategy: configure_optimizers returned {len(self.optimizers)} optimizers; "
                                 "the engine steps one. Return one optimizer over self.parameters().")
            opt = self.optimizers[0]
            self.optimizers = [opt if isinstance(opt, GeminiOptimizer) else GeminiOptimizer(opt, module)]
            self.optimizers[0].expect_backwards_per_step(int(trainer.accumulate_grad_batches))
        self.setup_precision_plugin()

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        """fp16: the loss is scaled here, since `training_step` may compute it from a submodule's
        outputs, which the engine's scaling at the LightningModule's outputs never sees."""
        if self.engine is None or self.engine.closed:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        with self.engine.scale_loss(closure_loss) as scaled:
            super().backward(scaled, optimizer, *args, **kwargs)
        return closure_loss

    def model_to_device(self) -> None:
        pass  # the engine placed the parameters (in chunks) and the buffers

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init=None):
        """configure_model and Trainer.init_module build on the meta device: the engine gives
        each module storage at set-up (the Note above); Lightning's precision plugin is left out,
        since the masters stay fp32 whatever the compute precision."""
        with torch.device("meta"):
            yield

    @contextlib.contextmanager
    def block_backward_sync(self):
        engine = self.engine
        if engine is not None and not engine.closed and (engine.world_size > 1 or
                                                         engine.config.optimizer_step_in_backward):
            with engine.no_sync():
                yield
        else:
            yield

    # --- checkpoints ---------------------------------------------------------------------------
    def _engine_open(self) -> bool:
        return self.engine is not None and not self.engine.closed

    def lightning_module_state_dict(self) -> dict:
        if not self._engine_open():  # after fit: the module holds ordinary parameters, saved as usual
            return super().lightning_module_state_dict()
        return {}  # the model is in the engine's checkpoint (save_checkpoint): no second copy

    def optimizer_state(self, optimizer) -> dict:
        return {}  # likewise the optimizer's state (after fit there is none: it ended with the engine)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if not self._engine_open():
            # trainer.save_checkpoint() after fit: teardown closed the engine and the module holds the
            # trained values, so the file is the default strategy's, with the model and no optimizer state.
            if self.engine is not None and self.is_global_zero:
                warnings.warn("GeminiStrategy: saving after fit ended: the checkpoint holds the trained model "
                              "(checkpoint['state_dict'], as the default strategy writes it) but no optimizer "
                              "state, which ended with the engine at teardown. To resume training with its "
                              "optimizer state, save during fit (a ModelCheckpoint callback).", stacklevel=2)
            checkpoint[CHECKPOINT_KEY] = {"model_only": True}
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        engine_dir = os.fspath(filepath) + ENGINE_SUFFIX
        self.engine.save_checkpoint(engine_dir)  # collective when sharded: every rank writes its shard
        checkpoint[CHECKPOINT_KEY] = {"engine_checkpoint": os.path.basename(engine_dir),
                                      "world_size": self.engine.world_size}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath) -> None:
        super().remove_checkpoint(filepath)
        engine_dir = os.fspath(filepath) + ENGINE_SUFFIX
        if self.is_global_zero and os.path.isdir(engine_dir):
            shutil.rmtree(engine_dir)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        self._restore_from = os.fspath(checkpoint_path) + ENGINE_SUFFIX
        self._restored = False
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        """Lightning restores the model first: the engine's checkpoint is loaded here, with the
        optimizer's state when fitting (the optimizer exists from setup() on)."""
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if checkpoint.get(CHECKPOINT_KEY, {}).get("model_only"):
            # saved after fit: the model alone, as a plain state dict
            if fitting:
                raise ValueError(f"GeminiStrategy: {self._restore_from[:-len(ENGINE_SUFFIX)]} was saved after fit "
                                 "ended and holds no optimizer state, so training cannot resume from it exactly. "
                                 "Resume from a checkpoint saved during fit (ModelCheckpoint), or start a new fit "
                                 "from these weights (load_from_checkpoint, or module.load_state_dict(...)).")
            self.engine.load_state_dict(checkpoint["state_dict"], strict=strict)
            self._restored = True
            return
        if self._restore_from is None or not os.path.isfile(os.path.join(self._restore_from, "index.json")):
            raise ValueError(f"GeminiStrategy: no engine checkpoint at {self._restore_from}; load a checkpoint a "
                             "GeminiStrategy saved (its model and optimizer are in the directory beside the file).")
        self.engine.load_checkpoint(self._restore_from, model_only=not fitting)  # masters, optimizer, steps, RNG
        self._restored = True

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if not self._restored:
            raise _C.InternalError("gemini_ext internal error (this is a bug, please report it): GeminiStrategy "
                                   "restores the optimizer's state with the model's from the engine's checkpoint, "
                                   "and the model was not restored first.")

    def teardown(self) -> None:
        if self.engine is not None and not self.engine.closed:
            self.engine.close()  # the module holds the trained values as ordinary parameters
        super().teardown()


GeminiStrategy.register_strategies(StrategyRegistry)
