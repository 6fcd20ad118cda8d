"""Environment variables of gemini_ext (docs/USAGE.md), read once at import.

GEMINI_EXT_ALLOCATOR  default | chunk     which allocator backs chunk memory
GEMINI_EXT_GPU_LIMIT  bytes or "16GiB"    cap on device bytes the engine plans for
GEMINI_EXT_DEVICE     auto | cuda | sim   default for GeminiConfig.device
GEMINI_EXT_LOG        warning | info | debug
GEMINI_EXT_SIM_COPY_DELAY_US  integer     (testing) each copy of the sim device sleeps a random
                                          0..N microseconds, to shake out ordering bugs
"""

from __future__ import annotations

import dataclasses
import logging
import os

from ._units import parse_bytes

ALLOCATOR_MODES = ("default", "chunk")
DEVICES = ("auto", "cuda", "sim")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclasses.dataclass(frozen=True)
class EnvSettings:
    allocator: str
    gpu_limit_bytes: int | None
    device: str
    log_level: str
    sim_copy_delay_us: int = 0


def _read() -> EnvSettings:
    allocator = os.environ.get("GEMINI_EXT_ALLOCATOR", "default").strip().lower() or "default"
    if allocator not in ALLOCATOR_MODES:
        raise ValueError(f"GEMINI_EXT_ALLOCATOR: expected one of {ALLOCATOR_MODES}, got {allocator!r}. "
                         "Unset it or pick one of those.")
    limit = os.environ.get("GEMINI_EXT_GPU_LIMIT", "").strip()
    gpu_limit_bytes = parse_bytes(limit, "GEMINI_EXT_GPU_LIMIT") if limit else None
    device = os.environ.get("GEMINI_EXT_DEVICE", "auto").strip().lower() or "auto"
    if device not in DEVICES:
        raise ValueError(f"GEMINI_EXT_DEVICE: expected one of {DEVICES}, got {device!r}.")
    log_level = os.environ.get("GEMINI_EXT_LOG", "warning").strip().lower() or "warning"
    if log_level not in LOG_LEVELS:
        raise ValueError(f"GEMINI_EXT_LOG: expected one of {LOG_LEVELS}, got {log_level!r}.")
    delay = os.environ.get("GEMINI_EXT_SIM_COPY_DELAY_US", "0").strip() or "0"
    if not delay.isdigit():
        raise ValueError(f"GEMINI_EXT_SIM_COPY_DELAY_US: expected a non-negative integer (microseconds), got "
                         f"{delay!r}.")
    return EnvSettings(allocator, gpu_limit_bytes, device, log_level, int(delay))


SETTINGS = _read()

logger = logging.getLogger("gemini_ext")
logger.setLevel(SETTINGS.log_level.upper())
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[gemini_ext %(levelname)s] %(message)s"))
    logger.addHandler(_handler)
    logger.propagate = False


def warn_at_caller(message: str, category: type = UserWarning) -> None:
    """warnings.warn pointed at the first frame outside gemini_ext and torch: the user's line that
    led here (an optimizer.step(), a forward), not the library frame that noticed it."""
    import sys
    import warnings

    import torch

    libraries = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, sys.modules[__package__]))
    frame, level = sys._getframe(1), 2  # stacklevel 2: the frame that called this function
    while frame is not None and frame.f_code.co_filename.startswith(libraries):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
