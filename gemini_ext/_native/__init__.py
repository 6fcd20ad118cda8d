"""The native module `gemini_ext._C`, loaded once, here: every module of the package that calls
into C++ imports `_C` from this one (`from .._native import _C`).

The build records the torch it compiled against in `built_for.py` beside this file (written by
setup.py; absent in a checkout never built). A native module compiled against another torch fails
with an undefined symbol, or worse loads and misbehaves, so the load checks the record first and
names both versions and the fix. A package installed without the extension (GEMINI_EXT_NATIVE=0)
loads as Python only: `_C` is None and `MISSING` is the ImportError that says how to build.
"""

import importlib

import torch  # the extension links against torch's libraries: loaded first

_PACKAGE = __name__.rpartition(".")[0]  # gemini_ext


def _load_native():
    """The native module, after checking it was built for the torch installed now: a native
    module compiled against another torch fails with an undefined symbol, or worse loads and
    misbehaves; this names both versions and the fix instead."""
    rebuild = ("Rebuild gemini_ext against the installed torch (from its source: pip install "
               "--no-build-isolation --force-reinstall --no-deps .), or install the torch it was built for.")
    try:
        from .built_for import TORCH_VERSION as built_for
    except ImportError:
        built_for = None
    if built_for is not None and built_for != torch.__version__:
        raise ImportError(f"gemini_ext was built against torch {built_for}, but torch {torch.__version__} is "
                          f"installed; its native module only loads with the torch it was compiled against. {rebuild}")
    try:
        native = importlib.import_module(f"{_PACKAGE}._C")  # (a missing module raises with its name)
    except ImportError as e:
        if built_for is None:
            error = ImportError(f"gemini_ext's native module is not built or did not load ({e}). Build it: "
                                "pip install --no-build-isolation . (or -e . in a checkout). Without it only "
                                "the checkpoint exporter works (gemini-ext export).")
            if isinstance(e, ModuleNotFoundError) and e.name == f"{_PACKAGE}._C":
                return None, error  # installed without the extension (GEMINI_EXT_NATIVE=0): Python only
            raise error from e
        raise ImportError(f"gemini_ext's native module (built against torch {built_for}) did not load under "
                          f"torch {torch.__version__}: {e}. {rebuild}") from e
    return native, None


_C, MISSING = _load_native()
