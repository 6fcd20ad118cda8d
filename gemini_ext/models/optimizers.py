"""The optimizers the example and the benchmarks train with, by name, with the same settings on
every system: AdamW (weight decay 0.1), SGD with momentum 0.9 (weight decay 0.1 as L2), and Lion
(weight decay 0.1, decoupled). Lion's learning rate is a third of the others', as its paper
advises against AdamW's."""

from __future__ import annotations

import sys

import torch

try:
    from ..optim.lion import Lion
except ImportError:  # loaded by path by a peer benchmark that must not load gemini_ext (bench/fsdp2_train.py)
    Lion = sys.modules["gx_lion"].Lion

OPTIMIZERS = ("adamw", "sgd", "lion")


def optimizer_spec(name: str, lr: float) -> tuple[type, dict]:
    """(optimizer class, keyword arguments) of `name`."""
    if name == "adamw":
        return torch.optim.AdamW, {"lr": lr, "weight_decay": 0.1}
    if name == "sgd":
        return torch.optim.SGD, {"lr": lr, "momentum": 0.9, "weight_decay": 0.1}
    if name == "lion":
        return Lion, {"lr": lr / 3, "weight_decay": 0.1}
    raise ValueError(f"optimizer {name!r}: expected one of {OPTIMIZERS}.")
