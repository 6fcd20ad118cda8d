"""Process-wide guards against silent no-ops on managed parameters, installed while an engine is open.

[Note: why the engine touches torch's globals, and how it leaves them]
Gradients live in chunks and `p.grad` stays None, so three everyday calls would silently do
nothing on a managed model: a torch optimizer built over its parameters (it skips parameters
without .grad: the model does not train), torch.nn.utils.clip_grad_norm_ (it sees no
gradients and returns 0) and Module.zero_grad (it clears no chunk: the next step would add
the old gradients in, as transformers' Trainer calls it). While at least one engine is open:
- a global optimizer step pre-hook (torch.optim.optimizer.register_optimizer_step_pre_hook)
  makes any optimizer other than the engine's raise at its step when it holds managed
  parameters, naming engine.optimizer(...);
- torch.nn.utils.clip_grad_norm_ (under both of its names) clips through the engine when it is
  given every trainable parameter of one engine (as Trainer and Lightning call it: the model's
  parameters), and raises, naming engine.clip_grad_norm_, for any other mix of managed
  parameters; clip_grad_value_ on managed parameters raises. Unmanaged parameters go to torch's
  own functions untouched;
- accelerate's Accelerator.clip_grad_norm_ (when accelerate was imported before an engine
  opened) goes to that same clip_grad_norm_ when given managed parameters: its own code reads
  `p.grad`, skips the None ones and would report 0 and clip nothing where
  `integrations.accelerate.prepare` was not called;
- torch.nn.Module.zero_grad clears the engine's gradient chunks when the module holds every
  trainable parameter of one engine (the model, or a wrapper around it), and raises for a module
  holding only some of them; other parameters are cleared by torch as usual.
When the last engine closes, the hook is removed and torch's functions are put back, so torch is
left as it was found. Code that imported clip_grad_norm_ by name before an engine opened keeps
torch's function; engine.clip_grad_norm_ (or `max_norm`) is the direct way.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref

import torch
import torch.nn.utils.clip_grad as _clip_grad_module
from torch.optim.optimizer import register_optimizer_step_pre_hook

_lock = threading.Lock()
_engines: "weakref.WeakSet" = weakref.WeakSet()
_installed: dict = {}


def engine_opened(engine) -> None:
    with _lock:
        _engines.add(engine)
        if not _installed:
            _install()
        _install_accelerate()  # accelerate may have been imported since the first engine opened


def engine_closed(engine) -> None:
    with _lock:
        _engines.discard(engine)
        if _installed and not any(not e.closed for e in _engines):
            _uninstall()


def _owner(p):
    """(engine, index) of an open engine managing `p`, or None."""
    for engine in list(_engines):
        if engine.closed:
            continue
        i = engine.find_parameter(p)
        if i is not None:
            return engine, i
    return None


def _install() -> None:
    # see [Note: why the engine touches torch's globals, and how it leaves them]
    _installed["hook"] = register_optimizer_step_pre_hook(_refuse_foreign_step)
    _installed["clip_norm"] = torch.nn.utils.clip_grad_norm_
    _installed["clip_value"] = torch.nn.utils.clip_grad_value_
    norm, value = _clip_norm(_installed["clip_norm"]), _clip_value(_installed["clip_value"])
    torch.nn.utils.clip_grad_norm_ = _clip_grad_module.clip_grad_norm_ = norm
    torch.nn.utils.clip_grad_value_ = _clip_grad_module.clip_grad_value_ = value
    _installed["zero_grad"] = torch.nn.Module.zero_grad
    torch.nn.Module.zero_grad = _module_zero_grad(_installed["zero_grad"])


def _install_accelerate() -> None:
    accelerate = sys.modules.get("accelerate")
    if "accelerate_clip" not in _installed and accelerate is not None and hasattr(accelerate, "Accelerator"):
        _installed["accelerate_clip"] = accelerate.Accelerator.clip_grad_norm_
        accelerate.Accelerator.clip_grad_norm_ = _accelerate_clip(accelerate.Accelerator.clip_grad_norm_)


def _uninstall() -> None:
    if "accelerate_clip" in _installed:
        sys.modules["accelerate"].Accelerator.clip_grad_norm_ = _installed.pop("accelerate_clip")
    torch.nn.Module.zero_grad = _installed.pop("zero_grad")
    _installed.pop("hook").remove()
    torch.nn.utils.clip_grad_norm_ = _clip_grad_module.clip_grad_norm_ = _installed.pop("clip_norm")
    torch.nn.utils.clip_grad_value_ = _clip_grad_module.clip_grad_value_ = _installed.pop("clip_value")


def _refuse_foreign_step(optimizer, args, kwargs):
    for group in optimizer.param_groups:
        for p in group["params"]:
            found = _owner(p)
            if found is None:
                continue
            engine, i = found
            if optimizer is engine.attached_optimizer:  # the engine's own: it steps the chunks
                return None
            cls = type(optimizer).__name__
            raise RuntimeError(
                f"gemini_ext: {cls}.step() would update parameter {engine.parameter_name(i)!r}, which gx.enable() "
                f"manages: its gradient lives in a chunk (p.grad is None) and its value in fp32 master chunks, so "
                f"this step would change nothing. Build the optimizer through the engine instead: "
                f"opt = engine.optimizer(torch.optim.{cls}, ...) (or gx.GeminiOptimizer(your_optimizer, model)).")
    return None


def _managed(params):
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    owned = [_owner(p) for p in params]
    return params, owned


def _clip_norm(original):
    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params, owned = _managed(parameters)
        engines = {id(o[0]): o[0] for o in owned if o is not None}
        if not engines:
            return original(params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                            foreach=foreach)
        if len(engines) == 1 and all(o is not None for o in owned):
            engine = next(iter(engines.values()))
            given = {o[1] for o in owned}
            trainable = {i for i, p in enumerate(engine.parameters()) if p.requires_grad}
            if trainable <= given:
                return engine.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        raise RuntimeError(
            "gemini_ext: torch.nn.utils.clip_grad_norm_ was given managed parameters mixed with others or only some "
            "of a managed model's parameters; their gradients live in chunks (p.grad is None), so torch would clip "
            "nothing. Clip all of the model's gradients with engine.clip_grad_norm_(max_norm) (or "
            "GeminiConfig(max_norm=...)), and other parameters in a separate call.")
    return clip_grad_norm_


def _accelerate_clip(original):
    @functools.wraps(original)
    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        params, owned = _managed(parameters)
        if any(o is not None for o in owned):  # the engine's clipping, or the refusal of a mix
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        return original(self, params, max_norm, norm_type=norm_type)
    return clip_grad_norm_


def _clip_value(original):
    @functools.wraps(original)
    def clip_grad_value_(parameters, clip_value, foreach=None):
        params, owned = _managed(parameters)
        if any(o is not None for o in owned):
            raise RuntimeError(
                "gemini_ext: torch.nn.utils.clip_grad_value_ on parameters gx.enable() manages would clip nothing "
                "(their gradients live in chunks, p.grad is None). Clip by norm instead: "
                "engine.clip_grad_norm_(max_norm) or GeminiConfig(max_norm=...).")
        return original(params, clip_value, foreach=foreach)
    return clip_grad_value_


def _module_zero_grad(original):
    @functools.wraps(original)
    def zero_grad(self, set_to_none: bool = True) -> None:
        _, owned = _managed(self.parameters())
        engines = {id(o[0]): o[0] for o in owned if o is not None}
        for engine in engines.values():
            given = {o[1] for o in owned if o is not None and o[0] is engine}
            trainable = {i for i, p in enumerate(engine.parameters()) if p.requires_grad}
            if not trainable <= given:
                raise RuntimeError(
                    f"gemini_ext: {type(self).__name__}.zero_grad() holds only some of the parameters gx.enable() "
                    "manages; their gradients live in chunks shared with the others, so they cannot be cleared "
                    "alone. Call zero_grad() on the whole model or on the engine's optimizer.")
            engine.zero_grad()
        original(self, set_to_none)  # parameters no engine manages (theirs have p.grad None already)
    return zero_grad
