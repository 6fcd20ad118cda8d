"""Build of gemini_ext and its native module gemini_ext._C.

CUDA is decided at build time, never from whether a GPU is present:
  * GEMINI_EXT_CUDA=1 forces a CUDA build, GEMINI_EXT_CUDA=0 a CPU-only one;
  * otherwise CUDA is built when torch is a CUDA build (torch.version.cuda) and an nvcc whose
    major version equals torch's CUDA major version is found (CUDA_HOME or PATH).
The C++ standard is left to torch's build helper (C++20 from torch 2.13 on, C++17 before).
Install with:  pip install --no-build-isolation .   (torch is never a build requirement)
"""

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def locate_cuda_home():
    """Sets CUDA_HOME when unset and `nvcc` on PATH is not inside a toolkit (a wrapper script,
    e.g. /usr/local/bin/nvcc): torch's build helper would otherwise take its grandparent folder
    and miss the CUDA headers. Must run before torch.utils.cpp_extension is imported."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
    candidates += sorted(glob.glob("/usr/local/cuda*"), reverse=True)
    for home in candidates:
        if os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")) and \
                os.path.exists(os.path.join(home, "bin", "nvcc")):
            os.environ["CUDA_HOME"] = home
            return


locate_cuda_home()
try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
except ImportError:  # pragma: no cover - a clear message instead of a traceback
    sys.exit("gemini_ext needs torch installed before it is built: pip install torch, then "
             "pip install --no-build-isolation .")


def nvcc_major():
    """Major version of the nvcc that torch's build helper would use, or None."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    match = re.search(r"release (\d+)\.", out)
    return int(match.group(1)) if match else None


def want_cuda():
    forced = os.environ.get("GEMINI_EXT_CUDA")
    if forced not in (None, "", "0", "1"):
        sys.exit(f"GEMINI_EXT_CUDA must be 0 or 1, got {forced!r}")
    torch_cuda = torch.version.cuda
    nvcc = nvcc_major()
    if forced == "0":
        return False
    if forced == "1":
        if torch_cuda is None:
            sys.exit(f"GEMINI_EXT_CUDA=1, but torch {torch.__version__} is a CPU build; install a CUDA "
                     "build of torch or unset GEMINI_EXT_CUDA.")
        if nvcc is None:
            sys.exit("GEMINI_EXT_CUDA=1, but no nvcc was found; set CUDA_HOME or put nvcc on PATH.")
        return True
    if torch_cuda is None or nvcc is None:
        return False
    if int(torch_cuda.split(".")[0]) != nvcc:
        print(f"gemini_ext: torch is built for CUDA {torch_cuda} but nvcc is CUDA {nvcc}; building CPU-only "
              "(set GEMINI_EXT_CUDA=1 to insist)", file=sys.stderr)
        return False
    return True


def sources(*patterns):
    return sorted(s for p in patterns for s in glob.glob(os.path.join("csrc", p)))


use_cuda = want_cuda()
# -g0: no debug information (Python's own flags ask for -g; with torch's headers it nearly doubles
# the compile time of each file).
cxx_flags = ["-O3", "-g0", "-Wall", "-Wno-unused-parameter"]
define_macros = []
src = sources("core/*.cpp", "torch/*.cpp", "bindings/*.cpp")
if use_cuda:
    src += sources("cuda/*.cpp", "cuda/*.cu")
    define_macros.append(("GX_WITH_CUDA", "1"))
    ext = CUDAExtension(
        "gemini_ext._C", src, include_dirs=[os.path.join(ROOT, "csrc")], define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]}, libraries=["cudart"])
else:
    ext = CppExtension("gemini_ext._C", src, include_dirs=[os.path.join(ROOT, "csrc")],
                       define_macros=define_macros, extra_compile_args={"cxx": cxx_flags})

print(f"gemini_ext: building {'CUDA' if use_cuda else 'CPU-only'} extension against torch {torch.__version__}",
      file=sys.stderr)

setup(
    packages=find_packages(include=["gemini_ext", "gemini_ext.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)},
)
