"""The ordering of copies and compute does not depend on copies being fast: the parity, hook and
policy suites on the sim device again, with every copy sleeping a random 0..2 ms
(GEMINI_EXT_SIM_COPY_DELAY_US, read at import, hence a fresh interpreter)."""

from conftest import run_python


def test_suites_pass_with_random_copy_delays():
    out = run_python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cuda",
                     "tests/python/test_parity.py", "tests/python/test_hooks.py",
                     "tests/python/test_fetch_sequences.py",
                     "tests/python/test_policy_static.py", "tests/python/test_policy_auto.py",
                     "-k", "budget or home or prefetch or checkpointing or two_forwards or moving",
                     env={"GEMINI_EXT_SIM_COPY_DELAY_US": "2000"}, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout


def test_sharded_training_passes_with_random_copy_delays():
    """Prefetched gathers run on the copy stream after the shard's copy: under delays a missing
    order would show as wrong values."""
    out = run_python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cuda",
                     "tests/python/test_distributed.py",
                     "-k", "two_ranks and (tiny or home or keep or optim_on_host) or accumulation",
                     env={"GEMINI_EXT_SIM_COPY_DELAY_US": "2000"}, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout
