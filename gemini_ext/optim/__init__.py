"""Optimizers over the engine's chunks (`gx.optim`).

- wrapper.py: GeminiOptimizer, the torch.optim.Optimizer that `engine.optimizer(cls, ...)` builds.
- rules.py: the native optimizer families (Adam/AdamW, SGD, Adagrad, Lion): hyperparameters,
  state kinds and the kernels that step them.
- generic.py: any other torch.optim.Optimizer class, stepped chunk set by chunk set.
- lion.py: `gx.optim.Lion`, a torch.optim.Optimizer with a native CPU and device path.
"""

from .lion import Lion
from .wrapper import GeminiOptimizer

__all__ = ["GeminiOptimizer", "Lion"]
