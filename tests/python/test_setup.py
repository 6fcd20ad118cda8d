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
