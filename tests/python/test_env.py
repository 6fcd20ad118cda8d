from conftest import run_python


def _import_with(env):
    return run_python("-c", "import gemini_ext as gx; s = gx._env.SETTINGS; print(s.allocator, s.gpu_limit_bytes, "
                      "s.device, s.log_level)", env=env)


def test_environment_is_read_at_import():
    out = _import_with({"GEMINI_EXT_ALLOCATOR": "default", "GEMINI_EXT_GPU_LIMIT": "2GiB",
                        "GEMINI_EXT_DEVICE": "sim", "GEMINI_EXT_LOG": "info"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["default", str(2 * 2**30), "sim", "info"]


def test_bad_allocator_mode_fails_at_import_naming_the_variable():
    out = _import_with({"GEMINI_EXT_ALLOCATOR": "jemalloc"})
    assert out.returncode != 0
    assert "GEMINI_EXT_ALLOCATOR" in out.stderr and "jemalloc" in out.stderr


def test_bad_gpu_limit_fails_at_import():
    out = _import_with({"GEMINI_EXT_GPU_LIMIT": "lots"})
    assert out.returncode != 0 and "GEMINI_EXT_GPU_LIMIT" in out.stderr


def test_bad_sim_copy_delay_fails_at_import():
    out = _import_with({"GEMINI_EXT_SIM_COPY_DELAY_US": "-5"})
    assert out.returncode != 0
    assert "GEMINI_EXT_SIM_COPY_DELAY_US" in out.stderr and "non-negative integer" in out.stderr


def test_env_device_selects_the_engine_device():
    code = "import torch, gemini_ext as gx\nwith gx.enable(torch.nn.Linear(4, 4)) as e:\n    print(e.device_kind)\n"
    out = run_python("-c", code, env={"GEMINI_EXT_DEVICE": "sim"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("sim")
