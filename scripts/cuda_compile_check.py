"""Compile (never run) the CUDA-flavoured sources of the torch layer and bindings.

On machines with nvcc and CUDA headers but a CPU build of torch (CI), the extension is built
CPU-only, so `#ifdef GX_WITH_CUDA` code in csrc/torch and csrc/bindings would never be compiled.
This compiles those files (one unit per folder) with GX_WITH_CUDA=1 against torch's headers (the CPU wheel
ships c10/cuda) and the CUDA toolkit's headers, with -fsyntax-only: it catches rot between GPU
runs. Only files whose own text or project headers mention GX_WITH_CUDA are checked (the rest
compile identically in the CPU build); csrc/cuda's .cpp files are compiled and linked by the
CMake build of the C++ tests, and its CUDA kernels (.cu) are compiled here with nvcc when it is
on the PATH (to an object file that is thrown away).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cuda_include() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not home and shutil.which("nvcc"):
        home = os.path.dirname(os.path.dirname(os.path.realpath(shutil.which("nvcc"))))
    for candidate in filter(None, [home, "/usr/local/cuda"]):
        if os.path.exists(os.path.join(candidate, "include", "cuda_runtime_api.h")):
            return os.path.join(candidate, "include")
    return None


def mentions_cuda(path: str, seen: set) -> bool:
    """Whether `path` or a project header it includes (transitively) has GX_WITH_CUDA code."""
    if path in seen or not os.path.exists(path):
        return False
    seen.add(path)
    with open(path) as f:
        text = f.read()
    if "GX_WITH_CUDA" in text:
        return True
    return any(mentions_cuda(os.path.join(ROOT, "csrc", header), seen)
               for header in re.findall(r'#include "([^"]+)"', text))


def main() -> int:
    inc = cuda_include()
    if inc is None:
        print("cuda_compile_check: no CUDA headers found; nothing to check")
        return 0
    cxx = os.environ.get("CXX", "c++")
    # The standard torch's build helper would pick: C++20 from torch 2.13 on, C++17 before.
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    std = "-std=c++20" if (major, minor) >= (2, 13) else "-std=c++17"
    flags = [cxx, "-fsyntax-only", std, "-DGX_WITH_CUDA=1", "-DTORCH_EXTENSION_NAME=_C",
             "-DTORCH_API_INCLUDE_EXTENSION_H", "-I", os.path.join(ROOT, "csrc"), "-I", inc,
             "-I", sysconfig.get_paths()["include"]]
    for path in cpp_extension.include_paths():
        flags += ["-I", path]
    # CPU wheels ship c10/cuda's headers but not the header CMake generates for CUDA builds;
    # supply it (it only declares that c10_cuda is a shared library) when it is missing.
    shim = tempfile.mkdtemp(prefix="gx_cuda_shim_")
    if not any(os.path.exists(os.path.join(p, "c10", "cuda", "impl", "cuda_cmake_macros.h"))
               for p in cpp_extension.include_paths()):
        os.makedirs(os.path.join(shim, "c10", "cuda", "impl"))
        with open(os.path.join(shim, "c10", "cuda", "impl", "cuda_cmake_macros.h"), "w") as f:
            f.write("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        flags += ["-I", shim]
    files = [f for f in sorted(glob.glob(os.path.join(ROOT, "csrc", "torch", "*.cpp")) +
                               glob.glob(os.path.join(ROOT, "csrc", "bindings", "*.cpp")))
             if mentions_cuda(f, set())]

    names = {}
    nvcc = shutil.which("nvcc")
    kernels = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu"))) if nvcc else []

    # As the extension's unity build does: one translation unit per folder, so torch's headers
    # are parsed once per folder (the report names the folder's files).
    units = {}
    for f in files:
        units.setdefault(os.path.dirname(f), []).append(f)
    files = []
    for folder, members in sorted(units.items()):
        unit = os.path.join(shim, os.path.basename(folder) + "_unity.cpp")
        with open(unit, "w") as f:
            f.write("".join(f'#include "{m}"\n' for m in members))
        files.append(unit)
        names[unit] = ", ".join(os.path.relpath(m, ROOT) for m in members)

    def check(path):
        if path.endswith(".cu"):
            command = [nvcc, std, "-c", path, "-I", os.path.join(ROOT, "csrc"),
                       "-o", os.path.join(shim, os.path.basename(path) + ".o")]
            return path, subprocess.run(command, capture_output=True, text=True)
        return path, subprocess.run(flags + [path], capture_output=True, text=True)

    failed = 0
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for path, result in pool.map(check, files + kernels):
            status = "ok" if result.returncode == 0 else "FAILED"
            print(f"cuda_compile_check: {names.get(path) or os.path.relpath(path, ROOT)}: {status}")
            if result.returncode != 0:
                failed += 1
                print(result.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
