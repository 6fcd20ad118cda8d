import os
import subprocess
import sys

import pytest
import torch

import gemini_ext as gx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cuda_usable() -> bool:
    return bool(gx._C.build_info()["cuda"]) and torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if cuda_usable():
        if torch.cuda.device_count() < 2:
            skip = pytest.mark.skip(reason=f"needs 2 CUDA devices, this machine has {torch.cuda.device_count()} "
                                           "(see docs/TESTING.md)")
            for item in items:
                if "multigpu" in item.keywords:
                    item.add_marker(skip)
        return
    built_or_seen = torch.cuda.is_available() or gx._C.build_info()["cuda"]
    why = ("CUDA build of gemini_ext and a CUDA device needed" if built_or_seen
           else "no CUDA device (see docs/TESTING.md)")
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Device parameter for tests that run on both backends: sim everywhere, cuda on GPU machines.
DEVICES = [pytest.param("sim", id="sim"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]


def run_python(*args, env=None, timeout=600):
    """Runs `python args...` in a fresh interpreter (for env vars read at import). A variable
    given as None is removed from the child's environment."""
    full_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full_env, cwd=REPO,
                          timeout=timeout)
