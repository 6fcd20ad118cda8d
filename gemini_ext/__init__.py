"""gemini_ext: chunk-based heterogeneous memory management for PyTorch training.

    import gemini_ext as gx
    with gx.enable(model, gx.GeminiConfig(...)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=3e-4)
        ...
Environment variables are read once, here (see gemini_ext/_env.py and docs/USAGE.md).
"""

__version__ = "0.1.0"  # the one version string: pyproject.toml reads it from here

from ._env import SETTINGS as _SETTINGS  # noqa: F401,E402  (read the environment first, before CUDA)

import importlib  # noqa: E402

import torch  # noqa: E402  (the extension links against torch's libraries)


def _load_native():
    """The native module, after checking it was built for the torch installed now: a native
    module compiled against another torch fails with an undefined symbol, or worse loads and
    misbehaves; this names both versions and the fix instead."""
    rebuild = ("Rebuild gemini_ext against the installed torch (from its source: pip install "
               "--no-build-isolation --force-reinstall --no-deps .), or install the torch it was built for.")
    try:
        from ._built_for import TORCH_VERSION as built_for
    except ImportError:
        built_for = None
    if built_for is not None and built_for != torch.__version__:
        raise ImportError(f"gemini_ext was built against torch {built_for}, but torch {torch.__version__} is "
                          f"installed; its native module only loads with the torch it was compiled against. {rebuild}")
    try:
        native = importlib.import_module(f"{__name__}._C")  # (a missing module raises with its name)
    except ImportError as e:
        if built_for is None:
            error = ImportError(f"gemini_ext's native module is not built or did not load ({e}). Build it: "
                                "pip install --no-build-isolation . (or -e . in a checkout). Without it only "
                                "the checkpoint exporter works (gemini-ext export).")
            if isinstance(e, ModuleNotFoundError) and e.name == f"{__name__}._C":
                return None, error  # installed without the extension (GEMINI_EXT_NATIVE=0): Python only
            raise error from e
        raise ImportError(f"gemini_ext's native module (built against torch {built_for}) did not load under "
                          f"torch {torch.__version__}: {e}. {rebuild}") from e
    return native, None


__all__ = [
    "GeminiConfig", "GeminiEngine", "GeminiOptimizer", "DynamicLossScaler", "GeminiDDP", "GeminiPlugin", "Booster",
    "enable", "estimate", "search_chunk_configuration", "info", "parse_bytes", "format_bytes",
    "memory_stats", "reset_peak_memory_stats", "empty_cache", "resolve_device", "cuda_available",
    "UsageError", "OutOfMemoryError", "InternalError", "IllegalTransition", "TensorState",
]

_C, _NATIVE_MISSING = _load_native()
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

