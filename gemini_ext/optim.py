"""GeminiOptimizer: Adam / AdamW over the engine's fp32 master chunks (HybridAdam in C++).

[Note: what a step does]
1. Gradients still on the device (accumulated under no_sync) go to their optimizer's tier.
2. When clipping (`max_norm` > 0) or fp16 loss scaling needs it, the global gradient norm is
   computed over the gradient chunks: one host synchronisation per step, none per chunk.
3. fp16: a non-finite norm means overflow: the step is skipped (parameters, moments and step
   counts untouched) and the loss scaler backs off.
4. One factor, 1/loss_scale times the clipping coefficient max_norm / (norm + 1e-6) when that
   is below 1 (torch.nn.utils.clip_grad_norm_'s rule), is folded into every gradient read.
5. HybridAdam steps every chunk where its state lives: our fused CPU Adam on the host, torch's
   fused Adam on the device; the 16-bit parameters are rewritten from the masters. With
   `overlap_optimizer` (the default) host chunks are stepped on a background thread and step()
   returns; the next forward waits per chunk.
6. Speculation: when a backward pass begins, `_arm_for_backward` hands C++ the hyperparameters
   of that moment, so that each host chunk's step can start as soon as its gradients reach the
   host, out of place into spare buffers; step() confirms or drops each one (the Note in
   csrc/torch/hybrid_adam_speculation.cpp). It arms only where the guess "multiplier exactly 1"
   can hold (no fp16 loss scaler; clipping off, or the last norm within max_norm) and where the
   host has room for the spares (at most half of MemAvailable).
`param_groups` hold the same Parameter objects the model uses, so LR schedulers edit `lr` as
usual; hyperparameters are read from the groups at every step. Gradients live in chunks, not on
`p.grad` (which stays None), and `zero_grad()` clears them.
"""

from __future__ import annotations

import math

import torch

from . import _C
from .policy import mem_available_bytes

SUPPORTED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)
# Accepted hints: the engine always steps with fused kernels of its own (CPU Adam on the host,
# torch's fused Adam on the device), which is what fused=True / foreach=True ask for; the values
# change nothing and are documented as such.
_IGNORED_FLAGS = ("foreach", "fused")
# Refused unless False: behaviours the engine does not have (AMSGrad, maximising, a step that is
# captured in a CUDA graph or differentiated through).
_REFUSED_FLAGS = ("amsgrad", "maximize", "differentiable", "capturable")


def check_optimizer_class(cls) -> bool:
    """True for AdamW-style (decoupled) weight decay; TypeError for anything unsupported."""
    if not (isinstance(cls, type) and issubclass(cls, SUPPORTED_OPTIMIZERS)):
        name = getattr(cls, "__name__", repr(cls))
        raise TypeError(f"gemini_ext optimizer: {name} is not supported; supported: torch.optim.Adam, "
                        "torch.optim.AdamW (pass the class, e.g. engine.optimizer(torch.optim.AdamW, lr=3e-4)).")
    return issubclass(cls, torch.optim.AdamW)


class GeminiOptimizer(torch.optim.Optimizer):
    """Built by `engine.optimizer(cls, **kw)`, or as `GeminiOptimizer(torch_optimizer, model)`."""

    def __init__(self, optimizer_or_engine, model_or_cls=None, params=None, **kwargs):
        from .engine import GeminiEngine  # circular at import time only
        shared_groups = None
        self._wrapped = None
        if isinstance(optimizer_or_engine, GeminiEngine):
            engine, opt_cls = optimizer_or_engine, model_or_cls
        elif isinstance(optimizer_or_engine, torch.optim.Optimizer):
            # Seed-compatible form: GeminiOptimizer(torch.optim.AdamW(model.parameters(), ...), model)
            torch_opt = optimizer_or_engine
            model = model_or_cls
            engine = getattr(model, "_gemini_engine", None) if model is not None else None
            if engine is None and isinstance(getattr(model, "module", None), torch.nn.Module):
                engine = getattr(model.module, "_gemini_engine", None)  # a GeminiDDP
            if engine is None:
                raise ValueError("GeminiOptimizer(optimizer, model): `model` must be a module managed by gemini_ext "
                                 "(wrap it with gx.GeminiDDP(model) or gx.enable(model) first).")
            opt_cls = type(torch_opt)
            params = [dict(g) for g in torch_opt.param_groups]
            kwargs = {}
            shared_groups = torch_opt.param_groups
            self._wrapped = torch_opt
        else:
            raise TypeError("GeminiOptimizer: expected (engine, optimizer class) or (torch optimizer, model), got "
                            f"{type(optimizer_or_engine).__name__}.")
        self._adamw = check_optimizer_class(opt_cls)
        for flag in _REFUSED_FLAGS:
            if kwargs.get(flag, False) or any(g.get(flag, False) for g in (params or []) if isinstance(g, dict)):
                raise ValueError(f"gemini_ext optimizer: {flag}=True is not supported (the engine's step has no such "
                                 f"mode); pass {flag}=False or leave it out.")
        defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2 if self._adamw else 0.0,
                    "decoupled_weight_decay": self._adamw}
        for key, value in kwargs.items():
            if key in defaults:
                defaults[key] = value
            elif key not in _IGNORED_FLAGS + _REFUSED_FLAGS:
                raise TypeError(f"gemini_ext optimizer: unexpected argument {key!r} for {opt_cls.__name__}; "
                                "accepted: lr, betas, eps, weight_decay.")
        self._check_hyper(defaults, "defaults")
        self.engine = engine
        self.opt_class = opt_cls
        if params is None:
            params = [p for p in engine.parameters() if p.requires_grad]
        super().__init__(params, defaults)
        if shared_groups is not None:
            # The wrapped optimizer's group dicts themselves: an LR scheduler built on it edits ours.
            self.param_groups = shared_groups
        for i, g in enumerate(self.param_groups):
            self._check_hyper(g, f"param_groups[{i}]")
            if shared_groups is None:
                for flag in _REFUSED_FLAGS + _IGNORED_FLAGS:
                    g.pop(flag, None)
        group_of = [-1] * engine.num_parameters
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                idx = engine.parameter_index(p)
                if not p.requires_grad:
                    raise ValueError(f"gemini_ext optimizer: parameter {engine.parameter_name(idx)!r} has "
                                     "requires_grad=False; frozen parameters have no optimizer state. Leave it out.")
                group_of[idx] = gi
        self._group_of = group_of
        self._hybrid = _C.HybridAdam(engine._gm)
        self._hybrid.set_param_groups(group_of)
        self.last_grad_norm = None
        engine._register_optimizer(self)

    @staticmethod
    def _check_hyper(group: dict, where: str) -> None:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            lr = lr.item()
        if not lr >= 0.0:
            raise ValueError(f"{where}: lr must be >= 0, got {lr}.")
        b1, b2 = group["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"{where}: betas must be in [0, 1), got {group['betas']}.")
        if not group["eps"] >= 0.0:
            raise ValueError(f"{where}: eps must be >= 0, got {group['eps']}.")
        if not group["weight_decay"] >= 0.0:
            raise ValueError(f"{where}: weight_decay must be >= 0, got {group['weight_decay']}.")

    def _hyper(self) -> list[dict]:
        out = []
        for g in self.param_groups:
            lr = g["lr"].item() if isinstance(g["lr"], torch.Tensor) else float(g["lr"])
            out.append({"lr": lr, "beta1": float(g["betas"][0]), "beta2": float(g["betas"][1]), "eps": float(g["eps"]),
                        "weight_decay": float(g["weight_decay"]),
                        "adamw": bool(g.get("decoupled_weight_decay", self._adamw))})
        return out

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine = self.engine
        engine._check_open("optimizer.step")
        engine._check_no_stray_grads()
        engine._access.absorb_writes()  # in-place writes to parameters reach the masters before the step
        gm = engine._gm
        engine._end_iteration()  # the access trace of forward + backward is complete
        gm.flush_grads()
        scaler = engine.scaler
        scale = scaler.scale if scaler is not None else 1.0
        clipped = engine._clipper.take()  # engine.clip_grad_norm_ since the last step (1.0: none)
        multiplier = clipped / scale
        max_norm = engine.config.max_norm
        if max_norm > 0 or scaler is not None:
            norm = math.sqrt(self._hybrid.grad_norm_sq()) / scale * clipped
            self.last_grad_norm = norm
            if scaler is not None:
                found_inf = not math.isfinite(norm)
                scaler.update(found_inf)
                if found_inf:
                    engine._skipped_steps += 1
                    return loss
            if max_norm > 0:
                coef = max_norm / (norm + 1e-6)
                if coef < 1.0:
                    multiplier *= coef
        self._hybrid.step(self._hyper(), multiplier)
        gm.guard_stepping_params()  # parameters of CPU steps still running refuse access until settled
        engine._optimizer_steps += 1
        if self._wrapped is not None:
            self._wrapped._opt_called = True  # what an LR scheduler built on the wrapped optimizer checks
        return loss

    def _arm_for_backward(self) -> None:
        engine = self.engine
        cfg = engine.config
        if not cfg.overlap_optimizer or engine.scaler is not None:
            return
        if engine._clipper.clipped_last:  # the user clips, and the last call did: the multiplier will not be 1
            return
        if cfg.max_norm > 0 and not (self.last_grad_norm is not None and self.last_grad_norm <= cfg.max_norm):
            return
        needed = self._hybrid.spare_bytes_needed()
        if needed > 0 and needed > (mem_available_bytes() or 0) // 2:  # unreadable: no speculation
            return
        self._hybrid.arm(self._hyper())

    def speculation_stats(self) -> dict:
        """Speculative host steps confirmed and dropped so far, and the spare bytes held."""
        return {**self._hybrid.speculations(), "spare_bytes": self._hybrid.spare_bytes()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine._check_open("optimizer.zero_grad")
        self.engine._gm.zero_grad()
        self.engine._clipper.reset()

    def last_step_stats(self) -> dict:
        return self._hybrid.last_step()

    # --- state ------------------------------------------------------------------------------
    def _ordered_params(self):
        """(global position, engine index) in the order torch.optim numbers parameters."""
        pos = 0
        for g in self.param_groups:
            for p in g["params"]:
                yield pos, self.engine.parameter_index(p)
                pos += 1

    def state_dict(self) -> dict:
        """torch.optim.Adam(W)'s format: per parameter step, exp_avg, exp_avg_sq (fp32, CPU)."""
        gm = self.engine._gm
        state = {}
        for pos, idx in self._ordered_params():
            step = gm.step_of(idx)
            if step == 0:
                continue  # never stepped: torch has no state for it either
            state[pos] = {"step": torch.tensor(float(step)), "exp_avg": gm.read("exp_avg", idx),
                          "exp_avg_sq": gm.read("exp_avg_sq", idx)}
        gm.release_read_cache()  # the last chunk gathered for the reads (sharded)
        groups = []
        pos = 0
        for g in self.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry.update({"amsgrad": False, "maximize": False})
            entry["params"] = list(range(pos, pos + len(g["params"])))
            pos += len(g["params"])
            groups.append(entry)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"optimizer.load_state_dict: {len(groups)} param groups in the state dict, this "
                             f"optimizer has {len(self.param_groups)}; build the optimizer with the same groups.")
        for i, (saved, mine) in enumerate(zip(groups, self.param_groups)):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(f"optimizer.load_state_dict: param group {i} has {len(saved['params'])} parameters "
                                 f"in the state dict and {len(mine['params'])} here.")
        gm = self.engine._gm
        saved_ids = [pid for g in groups for pid in g["params"]]
        state = state_dict["state"]
        for (pos, idx), saved_id in zip(self._ordered_params(), saved_ids):
            entry = state.get(saved_id)
            if entry is None:
                gm.set_step(idx, 0)
                zero = torch.zeros(self.engine.parameter_numel(idx))
                gm.write("exp_avg", idx, zero)
                gm.write("exp_avg_sq", idx, zero)
                continue
            step = entry["step"]
            gm.set_step(idx, int(step.item() if isinstance(step, torch.Tensor) else step))
            gm.write("exp_avg", idx, entry["exp_avg"].detach().float().cpu())
            gm.write("exp_avg_sq", idx, entry["exp_avg_sq"].detach().float().cpu())
        for saved, mine in zip(groups, self.param_groups):
            for k, v in saved.items():
                if k not in ("params",) + _REFUSED_FLAGS + _IGNORED_FLAGS:
                    mine[k] = v
