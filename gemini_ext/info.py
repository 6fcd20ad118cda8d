"""`python -m gemini_ext info`: what was built and what this machine offers."""

from __future__ import annotations

import platform

import torch

from ._native import _C
from ._env import SETTINGS


def info() -> dict:
    build = _C.build_info()
    if torch.cuda.is_available() and build["cuda"]:
        device = f"cuda ({torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} device(s))"
    elif torch.cuda.is_available():
        device = "sim (torch sees a GPU but this build is CPU-only)"
    else:
        device = "sim (no CUDA device)"
    from .allocator import mode
    active = mode()
    allocator = active + (" (process-wide: every CUDA allocation goes through gemini_ext)" if active == "chunk" else
                          " (chunk pools for chunks, PyTorch's caching allocator for the rest)")
    if SETTINGS.allocator != active:
        allocator += f"; GEMINI_EXT_ALLOCATOR={SETTINGS.allocator} was requested but is not installed"
    return {
        "gemini_ext build": "CUDA" if build["cuda"] else "CPU-only",
        "CUDA version (build)": build["cuda_version"] or "none",
        "SIMD ISA": f"{build['simd_isa']} (detected {build['simd_detected']}; cpu: {build['cpu_features']})",
        "torch": f"{torch.__version__} (compiled against {build['torch_compiled']}, CUDA {torch.version.cuda})",
        "python": platform.python_version(),
        "C++ standard": str(build["cplusplus"]),
        "allocator mode": allocator,
        "device": device,
        "default engine device": SETTINGS.device,
        "GPU limit": SETTINGS.gpu_limit_bytes or "none",
    }


def print_info() -> None:
    rows = info()
    width = max(len(k) for k in rows)
    for key, value in rows.items():
        print(f"{key:<{width}}  {value}")
