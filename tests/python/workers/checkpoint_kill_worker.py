"""Run by test_checkpoint: saves killed with SIGKILL at random moments, TRIALS times, in one
interpreter (torch is imported once; each trial is a forked child that trains a small model and
saves to PATH in a loop until it is killed, at a random moment within its first three saves: the
period of a save is measured here first and lengthened whenever a child was killed before it
committed one, as on a loaded machine). After every kill this process checks what PATH
holds, as a later run would find it: the directory and its index exist, every file the index
names loads (weights_only, its size and CRC-32 as recorded) and agrees with the index. At the
end the last checkpoint loads into an engine. Prints a JSON report, with the most files ever found
beside the committed checkpoint's."""

import json
import os
import random
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/python: the shared helpers

import torch

torch.set_num_threads(1)  # no thread pool before fork()

import gemini_ext as gx  # noqa: E402
from gemini_ext.checkpoint import read_file  # noqa: E402
from parity_utils import batch, config, make_models  # noqa: E402


def _engine():
    model, _ = make_models()
    engine = gx.enable(model, config("sim"))
    return model, engine, engine.optimizer(torch.optim.AdamW, lr=1e-3)


def _step_and_save(model, engine, opt, step, path):
    x, y = batch(model.cfg, step, engine.compute_device)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    engine.save_checkpoint(path)


def _save_forever(path: str, ready: int) -> None:
    model, engine, opt = _engine()
    os.write(ready, b"r")  # set up: the saves start now
    for step in range(10 ** 9):
        _step_and_save(model, engine, opt, step, path)
        os.write(ready, b"s")  # one save committed


def _committed(ready_read: int) -> int:
    """The saves a killed child reported committed (the rest of its pipe, to EOF); closes the pipe."""
    reported = b""
    while chunk := os.read(ready_read, 4096):
        reported += chunk
    os.close(ready_read)
    return reported.count(b"s")


def _check(path: str) -> dict:
    with open(os.path.join(path, "index.json")) as f:
        index = json.load(f)
    sums = index.get("checksums") or [None] * len(index["files"])
    for name, checksum in zip(index["files"], sums):
        payload = read_file(os.path.join(path, name), checksum=checksum)
        assert payload["engine"]["optimizer_steps"] == index["optimizer_steps"], (name, index)
    return index


def main(path: str, trials: int) -> None:
    rng = random.Random(0)
    model, engine, opt = _engine()  # a first checkpoint, saved to the end; warms up what a child needs
    started = time.perf_counter()
    for step in range(3):
        _step_and_save(model, engine, opt, step, path)
    period = (time.perf_counter() - started) / 3  # one step and save, on this machine now
    engine.close()
    generations, steps, worst = [], [], []
    for _ in range(trials):
        ready_read, ready_write = os.pipe()
        child = os.fork()
        if child == 0:
            try:
                os.close(ready_read)
                _save_forever(path, ready_write)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
        os.close(ready_write)
        ready = os.read(ready_read, 1)  # the child is set up and saving
        if ready != b"r":  # it died setting up (its traceback is on stderr)
            os.close(ready_read)
            os.waitpid(child, 0)
            raise RuntimeError("a saving child failed before its first save; see its traceback above")
        time.sleep(rng.uniform(0.0, 3 * period))  # anywhere in its first three saves
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        if _committed(ready_read) == 0:  # the children save slower than measured (a loaded machine)
            period *= 1.5
        assert os.path.isdir(path), "the checkpoint's directory is missing"
        index = _check(path)
        # beside the committed checkpoint: at most what one killed save left (its rank file and,
        # killed between the index's write and its rename, its temporary index; or, killed after the
        # rename, the previous generation's file)
        left = sorted(set(os.listdir(path)) - set(index["files"]) - {"index.json"})
        worst = max(worst, left, key=len)
        generations.append(index["generation"])
        steps.append(index["optimizer_steps"])
    model, engine, opt = _engine()
    engine.load_checkpoint(path)
    loaded_steps = engine.stats()["optimizer_steps"]
    engine.close()
    print(json.dumps({"trials": trials, "generations": generations, "steps": steps, "loaded_steps": loaded_steps,
                      "leftovers": sorted(os.listdir(path)), "most_left_beside": worst}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
