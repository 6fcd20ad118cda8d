"""setup.py decides CUDA at build time; the refusals happen before anything is compiled."""

import os
import sys

import pytest
import torch

from conftest import REPO, run_python


def test_bad_gemini_ext_cuda_value_is_refused():
    out = run_python("setup.py", "--version", env={"GEMINI_EXT_CUDA": "2"})
    assert out.returncode != 0 and "GEMINI_EXT_CUDA must be 0 or 1" in out.stderr


def test_forcing_cuda_on_a_cpu_torch_is_refused():
    out = run_python("setup.py", "--version", env={"GEMINI_EXT_CUDA": "1"})
    if torch.version.cuda is None:
        assert out.returncode != 0 and "CPU build" in out.stderr
    else:
        assert out.returncode == 0, out.stderr


def test_build_kind_is_announced():
    out = run_python("setup.py", "--version", env={"GEMINI_EXT_CUDA": "0"})
    assert out.returncode == 0, out.stderr
    assert "building CPU-only extension" in out.stderr


def test_extension_sources_use_no_iostreams():
    """Formatting or parsing an integer through a std::ostream or std::istream inside the
    extension segfaulted on the GPU machine (torch 2.11, GCC 13; seen twice with cuda-gdb, in
    ostream::operator<<(long) and istream::operator>>(long)). The extension's sources therefore
    format with core/errors.h's concat and parse with POSIX calls; tests and benchmarks, which are
    their own programs, may use streams."""
    import pathlib
    import re

    csrc = pathlib.Path(__file__).resolve().parents[2] / "csrc"
    stream_headers = re.compile(r"#\s*include\s*<(iostream|[io]?fstream|[io]?stringstream|sstream|istream|ostream)>")
    offenders = [f"{path.relative_to(csrc)}: {m.group(0)}" for path in sorted(csrc.rglob("*"))
                 if path.suffix in {".h", ".cpp", ".cu", ".cuh"}
                 for m in stream_headers.finditer(path.read_text())]
    assert list(csrc.rglob("*.cpp")), f"no C++ sources found under {csrc}"
    assert offenders == [], ("use detail::concat / POSIX I/O instead of iostreams in the extension: "
                             + "; ".join(offenders))


def test_the_cpp_suite_configures_with_googletests_sources_alone(tmp_path):
    """Without an installed GoogleTest (Debian's libgtest-dev) the C++ build adds GoogleTest's sources
    (GX_GTEST_SOURCE, /usr/src/googletest by default); GoogleTest 1.11 and later define the
    GTest::gtest_main alias themselves, which the build must not define again."""
    import pathlib
    import shutil
    import subprocess

    source = pathlib.Path("/usr/src/googletest")
    if shutil.which("cmake") is None or not (source / "CMakeLists.txt").exists():
        pytest.skip("needs cmake and GoogleTest's sources in /usr/src/googletest (Debian's googletest)")
    repo = pathlib.Path(__file__).resolve().parents[2]
    done = subprocess.run(["cmake", "-S", str(repo / "csrc"), "-B", str(tmp_path),
                           "-DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON",
                           f"-DGX_GTEST_SOURCE={source}", "-DGX_WITH_CUDA=OFF"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_the_scripts_build_again_only_where_the_build_does_not_match():
    """scripts/setup_env.sh's build_action: a build of the same sources, importable from this checkout,
    is kept; where only an extra is missing (train.sh built without one, then test.sh asks for `test`),
    its packages are installed without compiling again; other sources or no importable build: a build."""
    import subprocess

    def action(*args):
        script = 'source scripts/setup_env.sh >/dev/null 2>&1; build_action "$@"'
        return subprocess.run(["bash", "-c", script, "bash", *args], capture_output=True, text=True,
                              cwd=REPO, env={"PATH": os.environ["PATH"], "PYTHON": sys.executable}).stdout.strip()

    assert action("h1", "h1", "", "", "1") == "keep"
    assert action("h1", "h1", "test", "test", "1") == "keep"
    assert action("h1", "h1", "", "test", "1") == "extras"
    assert action("h1", "h1", "transformers", "test", "1") == "extras"
    assert action("h2", "h1", "test", "test", "1") == "build"
    assert action("h1", "h1", "test", "test", "0") == "build"


def test_numpy_is_a_dependency():
    """torch warns at import ("Failed to initialize NumPy") in an environment without numpy: every
    command would print it in a venv made as the README says."""
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in deps), deps
