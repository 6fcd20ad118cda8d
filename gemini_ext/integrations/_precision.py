"""The engine's precision when a framework also names one (the Trainer's bf16 / fp16 arguments,
Lightning's `precision`)."""

from __future__ import annotations

from ..config import GeminiConfig


def agreed_precision(config: GeminiConfig, wanted: str | None, owner: str, asked_by: str) -> str:
    """`wanted` if the framework asks for a precision, else the config's. A config whose precision
    is not the default and differs from the framework's is a conflict (ValueError)."""
    if wanted is None:
        return config.precision
    if config.precision != wanted and config.precision != GeminiConfig().precision:
        raise ValueError(f"{owner}: {asked_by} asks for {wanted} and the config for precision={config.precision!r}; "
                         "set one of them (the engine computes in that precision).")
    return wanted
