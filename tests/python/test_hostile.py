"""A hostile user: every everyday action on a managed model is served or refused with a Python
error, never a crash and never a silent no-op (workers/hostile_worker.py runs the checks, one scenario
per process, so that a crash fails its test with the signal and the check it happened in)."""

import os
import signal
import subprocess
import sys

import pytest

from conftest import REPO
from dist_utils import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "hostile_worker.py")
import transformers  # noqa: E402,F401  (the suite builds transformers models; scripts/test.sh installs it)
from workers import hostile_worker  # noqa: E402

SINGLE = [s for s, (_, _, _, world) in hostile_worker.SCENARIOS.items() if world == 1]
MULTI = [s for s, (_, _, _, world) in hostile_worker.SCENARIOS.items() if world > 1]
ALL_CHECKS = [c.__name__[len("check_"):] for c in hostile_worker.CHECKS]


def _launch(scenario: str, device: str, rank: int = 0, world_size: int = 1, port: int = 0):
    args = [sys.executable, WORKER, scenario, device]
    if world_size > 1:
        args += [str(rank), str(world_size), str(port)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)


def _verdict(proc, timeout: int = 300) -> None:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the worker hung (killed after {timeout} s):\n{out[-4000:]}")
    lines = out.splitlines()
    began = [ln.split(" ", 1)[1] for ln in lines if ln.startswith("BEGIN ")]
    if proc.returncode != 0:
        how = f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit {proc.returncode}"
        where = began[-1] if began else "start-up"
        pytest.fail(f"the process ended by {how} during check '{where}' (an action must never end the process):\n"
                    f"{out[-4000:]}")
    failed = [ln for ln in lines if ln.startswith("FAIL ")]
    assert not failed, "\n".join(failed) + "\n" + out[-6000:]
    passed = [ln.split(" ", 1)[1] for ln in lines if ln.startswith("PASS ")]
    assert passed == ALL_CHECKS and lines[-1] == "DONE", out[-4000:]


@pytest.mark.parametrize("scenario", SINGLE)
@pytest.mark.parametrize("device", ["sim", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_every_action_on_a_managed_model_is_served_or_refused(scenario, device):
    _verdict(_launch(scenario, device))


@pytest.mark.parametrize("scenario", MULTI)
def test_every_action_on_a_model_sharded_over_two_gloo_ranks_is_served_or_refused(scenario):
    port = free_port()
    procs = [_launch(scenario, "sim", rank, 2, port) for rank in range(2)]
    for proc in procs:
        _verdict(proc)
