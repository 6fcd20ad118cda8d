"""gemini_ext: chunk-based heterogeneous memory management for PyTorch training.

    import gemini_ext as gx
    with gx.enable(model, gx.GeminiConfig(...)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=3e-4)
        ...
Environment variables are read once, here (see gemini_ext/_env.py and docs/USAGE.md).
"""

__version__ = "0.1.0"  # the one version string: pyproject.toml reads it from here

from ._env import SETTINGS as _SETTINGS  # noqa: F401,E402  (read the environment first, before CUDA)

from ._native import MISSING as _NATIVE_MISSING, _C  # noqa: E402  (the native module, loaded once)


__all__ = [
    "GeminiConfig", "GeminiEngine", "GeminiOptimizer", "DynamicLossScaler", "GeminiDDP", "GeminiPlugin", "Booster",
    "enable", "estimate", "search_chunk_configuration", "info", "parse_bytes", "format_bytes",
    "memory_stats", "reset_peak_memory_stats", "empty_cache", "resolve_device", "cuda_available",
    "UsageError", "OutOfMemoryError", "InternalError", "IllegalTransition", "TensorState",
]

if _C is None:
    # Python only: `gemini_ext.export` and the checkpoint format work (they need torch, not the
    # native module); every public name raises the ImportError that says how to build.
    def __getattr__(name):
        if name in __all__:
            raise _NATIVE_MISSING
        raise AttributeError(f"module 'gemini_ext' has no attribute {name!r}")  # submodules import as usual
else:
    from . import allocator as _allocator  # noqa: E402

    _allocator.install_if_requested()  # GEMINI_EXT_ALLOCATOR=chunk: before anything touches CUDA

    from .allocator import empty_cache, memory_stats, reset_peak_memory_stats  # noqa: E402
    from ._units import format_bytes, parse_bytes  # noqa: E402
    from .config import GeminiConfig  # noqa: E402
    from ._engine.device import cuda_available, resolve_device  # noqa: E402
    from .engine import GeminiEngine, enable  # noqa: E402
    from .info import info  # noqa: E402
    from .estimate import estimate  # noqa: E402
    from .optim import GeminiOptimizer  # noqa: E402
    from .amp import DynamicLossScaler  # noqa: E402
    from .compat import Booster, GeminiDDP, GeminiPlugin  # noqa: E402
    from .search import search_chunk_configuration  # noqa: E402

    UsageError = _C.UsageError
    OutOfMemoryError = _C.OutOfMemoryError
    InternalError = _C.InternalError
    IllegalTransition = _C.IllegalTransition
    TensorState = _C.TensorState

