"""The ColossalAI-style surface: GeminiDDP, GeminiPlugin and Booster.

They are thin layers over enable() / GeminiEngine with the argument names of the original
design, so that code written for it runs with few changes:

    model = gx.GeminiDDP(model, precision="bf16")                    # an nn.Module
    optim = gx.GeminiOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), model)

    booster = gx.Booster(plugin=gx.GeminiPlugin(precision="bf16"))
    model, optim, criterion, loader, sched = booster.boost(model, optim, criterion, loader, sched)
    booster.backward(loss, optim)
"""

from __future__ import annotations

import os

import torch

from .config import GeminiConfig
from .engine import GeminiEngine, enable
from .optim import GeminiOptimizer


class GeminiDDP(torch.nn.Module):
    """`module` with its parameters in chunks: the engine of enable() without a `with` block.
    state_dict() / load_state_dict() use the wrapped module's own keys (fp32, CPU)."""

    def __init__(self, module: torch.nn.Module, config: GeminiConfig | None = None, *, process_group=None,
                 **fields):
        super().__init__()
        self.module = module
        self.engine: GeminiEngine = enable(module, config, process_group=process_group, **fields)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def no_sync(self):
        return self.engine.no_sync()

    def state_dict(self, *args, **kwargs):
        return self.engine.state_dict()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.engine.load_state_dict(state_dict, strict=strict)

    def close(self) -> torch.nn.Module:
        """Restores ordinary parameters and returns the plain module."""
        self.engine.close()
        return self.module


class GeminiPlugin:
    """Holds the GeminiConfig fields (same names) for a Booster."""

    def __init__(self, **fields):
        self.config = GeminiConfig(**fields)


class Booster:
    def __init__(self, plugin: GeminiPlugin | None = None):
        if plugin is not None and not isinstance(plugin, GeminiPlugin):
            raise TypeError(f"Booster(plugin=...): expected a gx.GeminiPlugin, got {type(plugin).__name__}.")
        self.plugin = plugin or GeminiPlugin()

    def boost(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, criterion=None,
              dataloader=None, lr_scheduler=None):
        """Returns (GeminiDDP, GeminiOptimizer or None, criterion, dataloader, lr_scheduler). An LR
        scheduler built on `optimizer` keeps working: the GeminiOptimizer shares its param groups."""
        if not isinstance(model, GeminiDDP):
            model = GeminiDDP(model, self.plugin.config)
        if optimizer is not None and not isinstance(optimizer, GeminiOptimizer):
            optimizer = GeminiOptimizer(optimizer, model)
        return model, optimizer, criterion, dataloader, lr_scheduler

    def backward(self, loss: torch.Tensor, optimizer: GeminiOptimizer | None = None) -> None:
        """The optimizer's engine runs the backward (fp16: the loss scaled once, wherever it was
        computed); without one, loss.backward()."""
        if optimizer is not None:
            optimizer.engine.backward(loss)
        else:
            loss.backward()

    @staticmethod
    def _engine_of(model) -> GeminiEngine:
        if not isinstance(model, GeminiDDP):
            raise TypeError(f"expected a model returned by Booster.boost (a gx.GeminiDDP), got {type(model).__name__}.")
        return model.engine

    def save_model(self, model: GeminiDDP, path: str) -> None:
        """The full fp32 state dict, one file (torch.save), written to a temporary name first."""
        _atomic_save(self._engine_of(model).state_dict(), path)

    def load_model(self, model: GeminiDDP, path: str, strict: bool = True) -> None:
        self._engine_of(model).load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=strict)

    def save_optimizer(self, optimizer: GeminiOptimizer, path: str) -> None:
        _atomic_save(optimizer.state_dict(), path)

    def load_optimizer(self, optimizer: GeminiOptimizer, path: str) -> None:
        optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def _atomic_save(obj, path: str) -> None:
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
