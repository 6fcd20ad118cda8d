"""`GeminiFabricStrategy`: a `lightning.fabric` strategy training the model under a gemini_ext engine.

[Note: what Fabric hands to the engine]
`Fabric(strategy=GeminiFabricStrategy(gx.GeminiConfig(...)), precision=...)` (or
`strategy="gemini"` once this module is imported) keeps Fabric's launcher, process group,
data loaders and loop; the strategy gives the engine what concerns the parameters:
- `fabric.setup(model, optimizer)` enables the engine on the model (never moved to the device
  whole nor wrapped in DistributedDataParallel) and wraps the optimizer, a supported class's
  instance over `model.parameters()`, in `gx.GeminiOptimizer` (its param groups stay shared);
- `precision` ("32-true", "bf16-mixed" / "bf16-true", "16-mixed" / "16-true") chooses the
  engine's precision and Fabric's own autocast is off; a config asking for another precision is
  an error;
- `fabric.clip_gradients(model, optimizer, max_norm=...)` clips through the engine;
  `fabric.no_backward_sync(model)` is the engine's `no_sync()` when sharded or stepping in backward;
- `fabric.save(path, state)` writes Fabric's file (the model's state from the masters, the
  optimizer's torch-format state, the rest of `state`) and the engine's checkpoint in
  `<path>.gemini/`; `fabric.load(path, state)` restores from the latter, so training resumes
  exactly;
- `teardown` closes the engine: the model holds the trained values as ordinary parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl

from ..config import GeminiConfig
from ..engine import enable
from ..optim import GeminiOptimizer
from .lightning import ENGINE_SUFFIX, engine_precision, register_strategy_names


class _EngineNoSync(_BackwardSyncControl):
    def __init__(self, strategy):
        self._strategy = strategy

    def no_backward_sync(self, module, enabled: bool):
        engine = self._strategy.engine
        if not enabled or engine is None or engine.closed or (engine.world_size == 1 and
                                                              not engine.config.optimizer_step_in_backward):
            return contextlib.nullcontext()
        return engine.no_sync()


class GeminiFabricStrategy(DDPStrategy):
    strategy_name = "gemini"

    def __init__(self, config: GeminiConfig | None = None, **ddp_kwargs):
        super().__init__(**ddp_kwargs)
        self.config = config if config is not None else GeminiConfig()
        self.engine = None
        self._backward_sync_control = _EngineNoSync(self)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """Registers the names of gemini_ext.integrations.lightning.STRATEGY_NAMES for Fabric."""
        register_strategy_names(strategy_registry, cls)

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        module = self.setup_module(module)
        return module, [self.setup_optimizer(opt) for opt in optimizers], scheduler

    def setup_module(self, module):
        # see [Note: what Fabric hands to the engine]
        if self.engine is not None and not self.engine.closed:
            raise ValueError("GeminiFabricStrategy: a model is set up already; the strategy's engine manages one "
                             "model.")
        precision = engine_precision(self.precision.precision, self.config)
        self.engine = enable(module, dataclasses.replace(self.config, precision=precision))
        self.precision = Precision()  # the engine computes in its precision: no autocast on top
        return module

    def backward(self, tensor, module, *args, **kwargs) -> None:
        """fp16: the loss is scaled here (it may come from a submodule's outputs; see lightning.py)."""
        if self.engine is None or self.engine.closed:
            return super().backward(tensor, module, *args, **kwargs)
        with self.engine.scale_loss(tensor) as scaled:
            super().backward(scaled, module, *args, **kwargs)
        return None

    def setup_optimizer(self, optimizer):
        if self.engine is None or self.engine.closed:
            raise ValueError("GeminiFabricStrategy: set up the model first (fabric.setup(model, optimizer), or "
                             "fabric.setup_module(model) before fabric.setup_optimizers(optimizer)).")
        return optimizer if isinstance(optimizer, GeminiOptimizer) else GeminiOptimizer(optimizer, self.engine.model)

    def module_to_device(self, module) -> None:
        pass  # the engine placed the parameters (in chunks) and the buffers

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        return self.engine.clip_grad_norm_(max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)

    def get_module_state_dict(self, module) -> dict:
        return self.engine.state_dict()  # collective when sharded: every rank calls it

    def save_checkpoint(self, path, state, storage_options=None, filter=None) -> None:
        self.engine.save_checkpoint(os.fspath(path) + ENGINE_SUFFIX)
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    def load_checkpoint(self, path, state=None, strict=True, weights_only=None):
        engine_dir = os.fspath(path) + ENGINE_SUFFIX
        if not os.path.isdir(engine_dir):
            raise ValueError(f"GeminiFabricStrategy: no engine checkpoint at {engine_dir}; load a checkpoint a "
                             "GeminiFabricStrategy saved.")
        # The model and optimizer come from the engine's checkpoint (masters, state, steps, RNG),
        # exactly; Fabric restores the rest of `state` from its file.
        state = state if state is not None else {}
        rest = {k: v for k, v in state.items() if not _is_engine_object(v, self.engine)}
        remainder = super().load_checkpoint(path, rest, strict=strict, weights_only=weights_only)
        state.update(rest)  # Fabric restored these in place, in its copy of the dict
        self.engine.load_checkpoint(engine_dir)
        return {k: v for k, v in remainder.items() if k not in state}

    def teardown(self) -> None:
        if self.engine is not None and not self.engine.closed:
            self.engine.close()  # the model holds the trained values as ordinary parameters
        super().teardown()


def _is_engine_object(obj, engine) -> bool:
    inner = getattr(obj, "_forward_module", getattr(obj, "optimizer", obj))
    return inner is engine.model or obj is engine.model or isinstance(inner, GeminiOptimizer) or \
        isinstance(obj, GeminiOptimizer)


GeminiFabricStrategy.register_strategies(STRATEGY_REGISTRY)
