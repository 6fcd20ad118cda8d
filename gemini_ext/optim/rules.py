"""Optimizer rules: the math of one optimizer family behind one interface.

The engine steps chunk sets generically (residency, runs of slots, coherence of the copies, the
overlapped CPU pipeline, speculation: csrc/torch/optim/hybrid_optimizer*.cpp); a rule says what differs
between optimizers:
- `state_kinds`: the optimizer-state chunks every trainable chunk set carries beside its
  gradient and master, fp32 and laid out like the parameters (Adam: exp_avg, exp_avg_sq). The
  checkpoint pieces, `state_dict()` and `close()` iterate these kinds;
- which torch optimizer classes it stands for, their defaults and the arguments it accepts or
  refuses, and the hyperparameters validated per group;
- `kernel_hyper`: one group's hyperparameters as the C++ rule takes them (name -> float);
- `state_dict_extras`: the keys torch's own optimizer writes into each param group that the
  engine's step has no knob for.
- `state_has_step`: whether torch's state dict of that optimizer carries a "step" per parameter.
Native rules (Adam, SGD, Lion, Adagrad) step the chunks with fused kernels in C++ (csrc/core for
the CPU, csrc/torch for the device); every other torch.optim.Optimizer class is stepped by the
generic rule (generic.py). Adding a native optimizer means adding a rule here and its kernels in
C++, then registering it in NATIVE_RULES.
"""

from __future__ import annotations

import torch

from .lion import Lion


class OptimizerRule:
    name = ""  # the C++ rule stepping it (csrc/torch/optim/optimizer_rule.h)
    state_kinds: tuple[str, ...] = ()
    classes: tuple[type, ...] = ()
    # Accepted hints that change nothing (the engine always uses its fused kernels).
    ignored_flags: tuple[str, ...] = ()
    # Refused unless False: behaviours the engine's step does not have.
    refused_flags: tuple[str, ...] = ()
    state_has_step = True
    native = True  # stepped by a C++ rule (else by the user's optimizer over views: generic.py)

    def accepts(self, cls) -> bool:
        return isinstance(cls, type) and issubclass(cls, self.classes)

    def kinds_for(self, groups: list[dict]) -> tuple[str, ...]:
        """The state kinds the chunk sets carry for these param groups."""
        return self.state_kinds

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


def _check_range(group: dict, where: str, key: str, low: float = 0.0, high: float | None = None) -> None:
    value = _number(group[key])
    if not (value >= low and (high is None or value <= high)):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{where}: {key} must be {span}, got {group[key]}.")


class AdamRule(OptimizerRule):
    """torch.optim.Adam and AdamW: our fused CPU Adam on the host, our device Adam kernel (the same
    bits) on the device."""
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
        _check_range(group, where, "lr")
        b1, b2 = group["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"{where}: betas must be in [0, 1), got {group['betas']}.")
        _check_range(group, where, "eps")
        _check_range(group, where, "weight_decay")

    def kernel_hyper(self, group: dict, cls) -> dict:
        return {"lr": _number(group["lr"]), "beta1": float(group["betas"][0]), "beta2": float(group["betas"][1]),
                "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"]),
                "adamw": float(bool(group.get("decoupled_weight_decay", issubclass(cls, torch.optim.AdamW))))}

    def state_dict_extras(self) -> dict:
        return {"amsgrad": False, "maximize": False}


class SgdRule(OptimizerRule):
    """torch.optim.SGD (momentum, dampening, nesterov, weight_decay, maximize): CPU SGD on the
    host, elementwise torch ops on the device. One state, momentum_buffer, only when a group has
    momentum; torch's state dict carries no step."""
    name = "sgd"
    classes = (torch.optim.SGD,)
    ignored_flags = ("foreach", "fused")
    refused_flags = ("differentiable",)
    state_has_step = False

    def kinds_for(self, groups: list[dict]) -> tuple[str, ...]:
        return ("momentum_buffer",) if any(_number(g["momentum"]) != 0 for g in groups) else ()

    def defaults(self, cls) -> dict:
        return {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False,
                "maximize": False}

    def check_group(self, group: dict, where: str) -> None:
        for key in ("lr", "momentum", "weight_decay"):
            _check_range(group, where, key)
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"{where}: nesterov=True needs momentum > 0 and dampening 0, got momentum "
                             f"{group['momentum']} and dampening {group['dampening']}.")

    def kernel_hyper(self, group: dict, cls) -> dict:
        return {"lr": _number(group["lr"]), "momentum": float(group["momentum"]),
                "dampening": float(group["dampening"]), "weight_decay": float(group["weight_decay"]),
                "nesterov": float(bool(group["nesterov"])), "maximize": float(bool(group["maximize"]))}


class LionRule(OptimizerRule):
    """gx.optim.Lion: CPU Lion on the host, elementwise torch ops on the device; one state
    (exp_avg), no step."""
    name = "lion"
    state_kinds = ("exp_avg",)
    classes = (Lion,)
    ignored_flags = ("foreach",)
    state_has_step = False

    def defaults(self, cls) -> dict:
        return {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0}

    def check_group(self, group: dict, where: str) -> None:
        _check_range(group, where, "lr")
        b1, b2 = group["betas"]
        if not (0.0 <= b1 <= 1.0 and 0.0 <= b2 <= 1.0):
            raise ValueError(f"{where}: betas must be in [0, 1], got {group['betas']}.")
        _check_range(group, where, "weight_decay")

    def kernel_hyper(self, group: dict, cls) -> dict:
        return {"lr": _number(group["lr"]), "beta1": float(group["betas"][0]), "beta2": float(group["betas"][1]),
                "weight_decay": float(group["weight_decay"])}


class AdagradRule(OptimizerRule):
    """torch.optim.Adagrad (lr_decay, weight_decay, initial_accumulator_value, eps, maximize): CPU
    Adagrad on the host, elementwise torch ops on the device; one state (sum) and a step."""
    name = "adagrad"
    state_kinds = ("sum",)
    classes = (torch.optim.Adagrad,)
    ignored_flags = ("foreach", "fused")
    refused_flags = ("differentiable",)

    def defaults(self, cls) -> dict:
        return {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10,
                "maximize": False}

    def check_group(self, group: dict, where: str) -> None:
        for key in ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"):
            _check_range(group, where, key)

    def kernel_hyper(self, group: dict, cls) -> dict:
        return {"lr": _number(group["lr"]), "lr_decay": float(group["lr_decay"]),
                "weight_decay": float(group["weight_decay"]), "eps": float(group["eps"]),
                "initial_accumulator_value": float(group["initial_accumulator_value"]),
                "maximize": float(bool(group["maximize"]))}


class GenericRule(OptimizerRule):
    """Any other torch.optim.Optimizer: the user's class steps per-parameter views of the chunks
    (generic.py); its state is torch's, beside the masters."""
    name = "generic"
    classes = (torch.optim.Optimizer,)
    native = False


ADAM = AdamRule()
NATIVE_RULES = (ADAM, SgdRule(), LionRule(), AdagradRule())
GENERIC = GenericRule()
RULES = NATIVE_RULES + (GENERIC,)
# The most state chunks a native rule needs: the engine lays out this many per chunk set (they
# get memory only when an optimizer is attached) and plans placement for it until then.
MAX_STATE_KINDS = max(len(rule.state_kinds) for rule in NATIVE_RULES)


def rule_for(cls) -> OptimizerRule:
    """The rule stepping optimizer class `cls`; TypeError naming what is accepted otherwise."""
    for rule in RULES:
        if rule.accepts(cls):
            return rule
    name = getattr(cls, "__name__", repr(cls))
    raise TypeError(f"gemini_ext optimizer: {name} is not a torch.optim.Optimizer class. Pass an optimizer class "
                    "(torch.optim.AdamW, SGD, Adagrad and gx.optim.Lion have native kernels; any other "
                    "torch.optim.Optimizer subclass is stepped generically), e.g. "
                    "engine.optimizer(torch.optim.AdamW, lr=3e-4).")
