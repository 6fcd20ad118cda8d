"""Which engine manages which model, without hanging anything on the model.

A `weakref.WeakKeyDictionary` from the module to its open engine, and one from the engine to its
parts (_engine/contract.py): the entries go when the engine closes (or with the module).
`GeminiOptimizer` and the guards look engines and their parts up here rather than reach into an
engine; a second enable() of a managed module is refused here.
"""

from __future__ import annotations

import weakref

import torch

_engines: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()
_parts: "weakref.WeakKeyDictionary[object, object]" = weakref.WeakKeyDictionary()


def engine_of(module) -> object | None:
    """The open engine managing `module`, or the one managing `module.module` (a GeminiDDP)."""
    if not isinstance(module, torch.nn.Module):
        return None
    engine = _engines.get(module)
    if engine is None and isinstance(getattr(module, "module", None), torch.nn.Module):
        engine = _engines.get(module.module)
    return engine


def check_unmanaged(module: torch.nn.Module) -> None:
    """Raises when `module` is managed by an open engine already."""
    if _engines.get(module) is not None:
        raise RuntimeError(f"enable(): this {type(module).__name__} is already managed by an open engine; "
                           "close it (leave its `with` block) first.")


def register(module: torch.nn.Module, engine, parts) -> None:
    check_unmanaged(module)
    _engines[module] = engine
    _parts[engine] = parts


def unregister(module: torch.nn.Module, engine) -> None:
    if _engines.get(module) is engine:
        del _engines[module]
    _parts.pop(engine, None)


def parts_of(engine) -> object | None:
    """The parts of an open engine (what its optimizer, checkpoints and clipping use), else None."""
    return _parts.get(engine)


def is_open_engine(obj) -> bool:
    """Whether `obj` is an engine that manages a model now."""
    return any(engine is obj for engine in _engines.values())
