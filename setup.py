"""Build of gemini_ext and its native module gemini_ext._C.

CUDA is decided at build time, never from whether a GPU is present:
  * GEMINI_EXT_CUDA=1 forces a CUDA build, GEMINI_EXT_CUDA=0 a CPU-only one;
  * otherwise CUDA is built when torch is a CUDA build (torch.version.cuda) and an nvcc whose
    major version equals torch's CUDA major version is found (CUDA_HOME or PATH).
The C++ standard is left to torch's build helper (C++20 from torch 2.13 on, C++17 before).
Install with:  pip install --no-build-isolation .   (torch is never a build requirement)

The build records the torch it compiled against in gemini_ext/_native/built_for.py, beside the native
module, so that `import gemini_ext` under another torch fails with both versions named instead
of an undefined symbol.
"""

import glob
import os
import re
import shutil
import subprocess
import sys
import warnings

from setuptools import setup

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
# torch warns when numpy is absent, as it is while pip installs a fresh environment; the build needs none.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
except ImportError:  # a clear message instead of a traceback, before any compiler runs
    sys.exit("gemini_ext: torch is not importable in this build environment. The extension compiles "
             "against the torch of the environment it will run in, so it cannot be built in an isolated "
             "one: pip's default build isolation hides the installed torch (and installing one there would "
             "compile against a torch the extension does not load with). Install torch first "
             "(pip install torch), then build without isolation: pip install --no-build-isolation .")


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


BUILT_FOR_MODULE = os.path.join("_native", "built_for.py")  # read by gemini_ext/_native/__init__.py


def built_for_text() -> str:
    return ('"""Written by setup.py at build time: the torch the native module was compiled against."""\n\n'
            f"TORCH_VERSION = {torch.__version__!r}\n"
            f"CUDA = {use_cuda!r}\n")


class RecordingBuildExtension(BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)):
    """torch's build helper, plus the record of the torch it built against, written beside the
    native module (in the source tree for editable builds, in the build tree otherwise). A build
    from a checkout, editable or not, keeps its objects in build/ext-<python>-<cpu|cuda>/, so that
    the next build with ninja recompiles only what changed: `pip install .` then the scripts'
    editable install compile once (setuptools would use a new temporary folder each time)."""

    def run(self):
        if self.inplace or os.path.isdir(os.path.join(ROOT, ".git")):
            self.build_temp = os.path.join(ROOT, "build", f"ext-{sys.implementation.cache_tag}-"
                                                          f"{'cuda' if use_cuda else 'cpu'}")
        super().run()
        for ext in self.extensions:
            package_dir = os.path.dirname(self.get_ext_fullpath(ext.name))
            os.makedirs(os.path.join(package_dir, "_native"), exist_ok=True)
            with open(os.path.join(package_dir, BUILT_FOR_MODULE), "w") as f:
                f.write(built_for_text())


# What the extension compiles, under csrc/ (tests/python/test_packaging.py reads these two to
# check that the source distribution holds them and every header they include).
CPU_SOURCES = ("core/*.cpp", "core/kernels/*.cpp", "torch/*.cpp", "torch/manager/*.cpp", "torch/optim/*.cpp",
               "bindings/*.cpp")
CUDA_SOURCES = ("cuda/*.cpp", "cuda/*.cu")


def sources(*patterns):
    return sorted(s for p in patterns for s in glob.glob(os.path.join("csrc", p)))


# A unity build: the C++ sources of each folder compile as one translation unit that includes
# them (build/unity/<folder>.cpp), so torch's and pybind11's headers are parsed once per folder
# instead of once per file (about half the CPU time of a build). Files compiled for one
# instruction set (`*_avx2.cpp`, `*_avx512.cpp`: their `#pragma GCC target` regions must not
# be where a header is first parsed) stay on their own, as do CUDA sources.
# GEMINI_EXT_UNITY=0 compiles every file on its own (faster rebuilds after editing one file).
ISA_SPECIFIC = re.compile(r"_avx(2|512)\.cpp$")


def unity_sources(files: list[str]) -> list[str]:
    if os.environ.get("GEMINI_EXT_UNITY", "1") not in ("0", "1"):
        sys.exit(f"GEMINI_EXT_UNITY must be 0 or 1, got {os.environ['GEMINI_EXT_UNITY']!r}")
    if os.environ.get("GEMINI_EXT_UNITY", "1") == "0":
        return files
    groups, alone = {}, []
    for f in files:
        if ISA_SPECIFIC.search(f) or not f.endswith(".cpp"):
            alone.append(f)
        else:
            groups.setdefault(os.path.dirname(os.path.relpath(f, "csrc")), []).append(f)
    out_dir = os.path.join(ROOT, "build", "unity")
    os.makedirs(out_dir, exist_ok=True)
    out = []
    for folder, members in sorted(groups.items()):
        path = os.path.join(out_dir, folder.replace(os.sep, "_") + ".cpp")
        text = "// Generated by setup.py (unity build): the sources of csrc/%s.\n%s" % (
            folder, "".join(f'#include "{os.path.relpath(m, "csrc")}"\n' for m in members))
        if not os.path.exists(path) or open(path).read() != text:  # unchanged: ninja keeps the object
            with open(path, "w") as f:
                f.write(text)
        out.append(os.path.relpath(path, ROOT))
    return out + alone


use_cuda = want_cuda()
# -g0: no debug information (Python's own flags ask for -g; with torch's headers it nearly doubles
# the compile time of each file).
cxx_flags = ["-O3", "-g0", "-Wall", "-Wno-unused-parameter"]
define_macros = []
src = sources(*CPU_SOURCES) + (sources(*CUDA_SOURCES) if use_cuda else [])
src = unity_sources(src)
if use_cuda:
    define_macros.append(("GX_WITH_CUDA", "1"))
    ext = CUDAExtension(
        "gemini_ext._C", src, include_dirs=[os.path.join(ROOT, "csrc")], define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]}, libraries=["cudart"])
else:
    ext = CppExtension("gemini_ext._C", src, include_dirs=[os.path.join(ROOT, "csrc")],
                       define_macros=define_macros, extra_compile_args={"cxx": cxx_flags})

print(f"gemini_ext: building {'CUDA' if use_cuda else 'CPU-only'} extension against torch {torch.__version__}",
      file=sys.stderr)

setup(ext_modules=[ext], cmdclass={"build_ext": RecordingBuildExtension})
