import torch

import gemini_ext as gx
from conftest import run_python


def test_info_command_prints_build_torch_allocator_and_device():
    out = run_python("-m", "gemini_ext", "info")
    assert out.returncode == 0, out.stderr
    for key in ("gemini_ext build", "CUDA version", "SIMD ISA", "torch", "allocator mode", "device"):
        assert key in out.stdout, out.stdout
    assert "default" in out.stdout  # the allocator mode when GEMINI_EXT_ALLOCATOR is unset


def test_info_reflects_allocator_env():
    out = run_python("-m", "gemini_ext", "info")
    assert out.returncode == 0, out.stderr
    assert "allocator mode" in out.stdout and "default (" in out.stdout
    out = run_python("-m", "gemini_ext", "info", env={"GEMINI_EXT_ALLOCATOR": "chunk"})
    if gx._C.build_info()["cuda"] and torch.cuda.is_available():  # installed at import: info shows it
        assert out.returncode == 0, out.stderr
        assert "chunk (process-wide" in out.stdout
    else:  # cannot be installed here: the import says why instead of pretending
        assert out.returncode != 0 and "GEMINI_EXT_ALLOCATOR=chunk:" in out.stderr


def test_build_info_fields_are_consistent():
    b = gx._C.build_info()
    assert b["simd_isa"] in ("scalar", "avx2", "avx512")
    assert b["cplusplus"] >= 201703
    assert (b["cuda_version"] is None) == (not b["cuda"])
    import torch
    assert b["torch_compiled"].split("+")[0] == torch.__version__.split("+")[0]


def test_simd_cap_env_is_honoured_and_validated():
    out = run_python("-c", "import gemini_ext as gx; print(gx._C.build_info()['simd_isa'])",
                     env={"GEMINI_EXT_SIMD": "scalar"})
    assert out.returncode == 0 and out.stdout.strip() == "scalar", out.stderr
    out = run_python("-c", "import gemini_ext as gx; gx._C.build_info()", env={"GEMINI_EXT_SIMD": "sse9"})
    assert out.returncode != 0 and "GEMINI_EXT_SIMD" in out.stderr
