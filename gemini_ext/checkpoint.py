"""Checkpoints of an engine: written to a temporary directory, then renamed into place.

Format (version 1, one process). A checkpoint is a directory holding
- `index.json`: {"format": "gemini_ext.checkpoint", "version": 1, "world_size": 1, "files": [...],
  "precision": ..., "optimizer_steps": ..., "parameters": number of parameters}
- `rank00000.pt` (torch.save): {"model": full fp32 state dict (the masters for trainable
  parameters), "optimizer": GeminiOptimizer.state_dict() (torch.optim.AdamW's format) or None,
  "scaler": loss-scaler state or None, "engine": {"optimizer_steps", "skipped_steps"},
  "rng": {"cpu": torch RNG state, "cuda": CUDA RNG state or None}}.
Resuming restores the masters (the 16-bit parameters are their round-to-nearest copies, as
after a step), m, v, per-parameter step counts, the loss scale and the RNG states, so that
training continues bit-exactly. A save never leaves a half-written checkpoint under `path`:
files go to `path.tmp-<pid>` first, and the old checkpoint (if any) is replaced by renames.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

FORMAT = "gemini_ext.checkpoint"
VERSION = 1
SHARD = "rank00000.pt"


def save(engine, path: str) -> None:
    path = os.path.abspath(os.fspath(path))
    opt = engine._optimizer
    payload = {
        "model": engine.state_dict(),
        "optimizer": opt.state_dict() if opt is not None else None,
        "scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "engine": {"optimizer_steps": engine._optimizer_steps, "skipped_steps": engine._skipped_steps},
        "rng": {"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if engine.device_kind == "cuda" else None},
    }
    index = {"format": FORMAT, "version": VERSION, "world_size": 1, "files": [SHARD],
             "precision": engine.config.precision, "optimizer_steps": engine._optimizer_steps,
             "parameters": engine.num_parameters}
    tmp = f"{path}.tmp-{os.getpid()}"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        torch.save(payload, os.path.join(tmp, SHARD))
        with open(os.path.join(tmp, "index.json"), "w") as f:
            json.dump(index, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the previous checkpoint, if any, stays as it was
        raise
    old = None
    if os.path.exists(path):
        old = f"{path}.old-{os.getpid()}"
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old)


def load(engine, path: str) -> None:
    path = os.fspath(path)
    index_path = os.path.join(path, "index.json")
    if not os.path.isfile(index_path):
        raise FileNotFoundError(f"load_checkpoint: {index_path} does not exist; pass a directory written by "
                                "engine.save_checkpoint().")
    with open(index_path) as f:
        index = json.load(f)
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ValueError(f"load_checkpoint: {path} has format {index.get('format')!r} version {index.get('version')!r};"
                         f" expected {FORMAT!r} version {VERSION}.")
    if index.get("world_size") != 1:
        raise NotImplementedError(f"load_checkpoint: {path} was saved by {index.get('world_size')} ranks; loading "
                                  "sharded checkpoints comes with the ZeRO-3 stage.")
    payload = torch.load(os.path.join(path, SHARD), map_location="cpu", weights_only=False)
    engine.load_state_dict(payload["model"])
    opt = engine._optimizer
    if payload["optimizer"] is not None:
        if opt is None:
            raise RuntimeError("load_checkpoint: the checkpoint has optimizer state; create the optimizer with "
                               "engine.optimizer(...) before loading it.")
        opt.load_state_dict(payload["optimizer"])
    if payload["scaler"] is not None and engine.scaler is not None:
        engine.scaler.load_state_dict(payload["scaler"])
    engine._optimizer_steps = payload["engine"]["optimizer_steps"]
    engine._skipped_steps = payload["engine"]["skipped_steps"]
    torch.set_rng_state(payload["rng"]["cpu"])
    if payload["rng"]["cuda"] is not None and engine.device_kind == "cuda":
        torch.cuda.set_rng_state(payload["rng"]["cuda"])
