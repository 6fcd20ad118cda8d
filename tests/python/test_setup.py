"""setup.py decides CUDA at build time; the refusals happen before anything is compiled."""

import torch

from conftest import run_python


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
    assert offenders == [], "use detail::concat / POSIX I/O instead of iostreams in the extension: " + "; ".join(offenders)
