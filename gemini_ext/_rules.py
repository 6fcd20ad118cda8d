"""Optimizer rules: the math of one optimizer family behind one interface.

The engine steps chunk sets generically (residency, runs of slots, coherence of the copies, the
overlapped CPU pipeline, speculation: csrc/torch/hybrid_optimizer*.cpp); a rule says what differs
between optimizers:
- `state_kinds`: the optimizer-state chunks every trainable chunk set carries beside its
  gradient and master, fp32 and laid out like the parameters (Adam: exp_avg, exp_avg_sq). The
  checkpoint pieces, `state_dict()` and `close()` iterate these kinds;
- which torch optimizer classes it stands for, their defaults and the arguments it accepts or
  refuses, and the hyperparameters validated per group;
- `kernel_hyper`: one group's hyperparameters as the C++ rule takes them (name -> float);
- `state_dict_extras`: the keys torch's own optimizer writes into each param group that the
  engine's step has no knob for.
Adding an optimizer means adding a rule here and its kernels in C++ (csrc/core for the CPU,
csrc/torch for the device), then registering it in RULES.
"""

from __future__ import annotations

import torch


class OptimizerRule:
    name = ""  # the C++ rule stepping it (csrc/torch/optimizer_rule.h)
    state_kinds: tuple[str, ...] = ()
    classes: tuple[type, ...] = ()
    # Accepted hints that change nothing (the engine always uses its fused kernels).
    ignored_flags: tuple[str, ...] = ()
    # Refused unless False: behaviours the engine's step does not have.
    refused_flags: tuple[str, ...] = ()

    def accepts(self, cls) -> bool:
        return isinstance(cls, type) and issubclass(cls, self.classes)

    def defaults(self, cls) -> dict:
        raise NotImplementedError

    def check_group(self, group: dict, where: str) -> None:
        raise NotImplementedError

    def kernel_hyper(self, group: dict, cls) -> dict:
        raise NotImplementedError

    def state_dict_extras(self) -> dict:
        return {}


def _number(value) -> float:
    return value.item() if isinstance(value, torch.Tensor) else float(value)


class AdamRule(OptimizerRule):
    """torch.optim.Adam and AdamW: CPU Adam on the host, torch's fused Adam on the device."""
    name = "adam"
    state_kinds = ("exp_avg", "exp_avg_sq")
    classes = (torch.optim.Adam, torch.optim.AdamW)
    ignored_flags = ("foreach", "fused")
    refused_flags = ("amsgrad", "maximize", "differentiable", "capturable")

    def defaults(self, cls) -> dict:
        adamw = issubclass(cls, torch.optim.AdamW)
        return {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2 if adamw else 0.0,
                "decoupled_weight_decay": adamw}

    def check_group(self, group: dict, where: str) -> None:
        lr = _number(group["lr"])
        if not lr >= 0.0:
            raise ValueError(f"{where}: lr must be >= 0, got {lr}.")
        b1, b2 = group["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"{where}: betas must be in [0, 1), got {group['betas']}.")
        if not group["eps"] >= 0.0:
            raise ValueError(f"{where}: eps must be >= 0, got {group['eps']}.")
        if not group["weight_decay"] >= 0.0:
            raise ValueError(f"{where}: weight_decay must be >= 0, got {group['weight_decay']}.")

    def kernel_hyper(self, group: dict, cls) -> dict:
        return {"lr": _number(group["lr"]), "beta1": float(group["betas"][0]), "beta2": float(group["betas"][1]),
                "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"]),
                "adamw": float(bool(group.get("decoupled_weight_decay", issubclass(cls, torch.optim.AdamW))))}

    def state_dict_extras(self) -> dict:
        return {"amsgrad": False, "maximize": False}


ADAM = AdamRule()
RULES = (ADAM,)
# The rule whose state chunks enable() lays out (the optimizer is created after enable()).
LAYOUT_RULE = ADAM


def rule_for(cls) -> OptimizerRule:
    """The rule stepping optimizer class `cls`; TypeError naming what is accepted otherwise."""
    for rule in RULES:
        if rule.accepts(cls):
            return rule
    name = getattr(cls, "__name__", repr(cls))
    accepted = ", ".join(f"torch.optim.{c.__name__}" for rule in RULES for c in rule.classes)
    raise TypeError(f"gemini_ext optimizer: {name} is not supported; supported: {accepted} (pass the class, e.g. "
                    "engine.optimizer(torch.optim.AdamW, lr=3e-4)).")
