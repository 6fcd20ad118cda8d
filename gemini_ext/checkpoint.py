"""Checkpoints of an engine: written to a temporary directory, then renamed into place.

Format version 1 (one unsharded process). A checkpoint is a directory holding
- `index.json`: {"format": "gemini_ext.checkpoint", "version": 1, "world_size": 1, "files": [...], "generation",
  "precision": ..., "optimizer_steps": ..., "parameters": number of parameters,
  "frozen": whether the frozen parameters are in it}
- `rank00000-g<generation>.pt` (torch.save): {"model": full fp32 state dict (the masters for trainable
  parameters), "optimizer": GeminiOptimizer.state_dict() (the torch optimizer's format) or None,
  "optimizer_class": its class name or None, "scaler": loss-scaler state or None, "engine": {"optimizer_steps"},
  "rng": {"cpu": torch RNG state, "cuda": CUDA RNG state or None}}.
Resuming restores the masters (the 16-bit parameters are their round-to-nearest copies, as
after a step), the optimizer state, per-parameter step counts, the loss scale and the RNG states, so that
training continues bit-exactly.

[Note: a save killed at any moment]
`path` always holds a loadable checkpoint once one was saved: the index is the commit point. A
save writes its files under names of the next generation beside the current ones (fsynced),
then the new index under a temporary name, and renames it over `index.json` (one atomic rename);
only then are the files no index names removed (the previous generation's). Killed before the
rename, the previous index and its files are untouched; after it, the new ones are complete. A
save first removes the files no index names (a save killed before its commit left its own, one
killed after it the previous generation's), so at most one killed save's files are ever beside
the committed checkpoint, however many saves in a row are killed. `path` is never renamed away, so there is no
moment without it (tests/python/test_checkpoint.py kills saves at random moments). Files are
loaded with weights_only=True; a missing, truncated or corrupted one is refused naming it.
`load(..., model_only=True)` (either version) restores the masters and buffers alone, for an
engine without an optimizer (evaluation).

Format version 2 (sharded engines: a process group; every rank calls save and load). Each rank
writes only what it holds, so no rank gathers the model:
- `rank<r:05d>-g<generation>.pt` (torch.save) per rank r: {"rank", "world_size", "tensors": {parameter name:
  {kind: [begin, end, tensor]}}, "rng": that rank's RNG states}, where the tensor is fp32 (bf16
  for the moments under optimizer_state_dtype="bf16"; loading casts to the engine's own) and kind is "param"
  (the fp32 master; the parameter itself when frozen) and each state kind of the optimizer
  rule ("exp_avg" and "exp_avg_sq" for Adam, "momentum_buffer" for SGD with momentum, "exp_avg"
  for Lion, "sum" for Adagrad; when the engine has a natively stepped optimizer), and
  [begin, end) are the elements of the flattened parameter that lie in r's shard. Rank 0's file
  also has "common": {"names", "buffers" (full, fp32 CPU),
  "optimizer": {"param_groups" (hyperparameters, torch.optim's layout without "state"),
  "steps": per-parameter step counts, "class": the optimizer's class name, "generic": a
  generically stepped optimizer's whole state_dict() or None} or None, "scaler", "engine"
  (counters)}.
- `index.json`: {"format", "version": 2, "world_size", "files", "precision", "optimizer_steps",
  "parameters": [{"name", "shape", "numel", "trainable", "pieces": [[rank, begin, end], ...]}],
  "state_dict_keys": [[key, parameter name or None for a buffer], ...] in the model's order,
  "frozen"}.
`save(..., frozen=False)` (either version) leaves the frozen parameters out (a LoRA run saves its
adapter and the adapter's optimizer state, not the base): "frozen" is false in the index, the
model dict or "parameters" lists the trainable ones, and loading requires every trainable
parameter and leaves the frozen ones as the model holds them. A missing "frozen" means true.
Rank 0 creates `path` and picks the generation, every rank writes its file there, and once all
report success rank 0 commits the index (the Note above). Loading at any world size
(resharding), sharded or not: each rank computes the elements it holds, opens the files whose
pieces overlap them (memory-mapped: only those bytes are read) and writes its part. RNG states
are restored when the world size is the one saved (a bit-exact resume); otherwise they are left.
Version 1 checkpoints load into sharded engines too (each rank keeps its part of the full state).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import zlib

import torch
import torch.distributed as dist

FORMAT = "gemini_ext.checkpoint"
VERSION = 1
VERSION_SHARDED = 2
INDEX = "index.json"
OWN_FILE = re.compile(r"^(rank\d{5}(-g\d+)?\.pt|index\.json\.tmp-\d+)$")  # what a save may remove


def rank_file(rank: int, generation: int) -> str:
    return f"rank{rank:05d}-g{generation}.pt"


def _begin_generation(path: str) -> int:
    """One more than the generation of the checkpoint in `path` (1 when there is none), after
    removing what earlier saves killed before they finished left there (the Note above)."""
    try:
        with open(os.path.join(path, INDEX)) as f:
            index = json.load(f)
        generation, committed = int(index.get("generation", 0)), set(index["files"])
    except FileNotFoundError:
        generation, committed = 0, set()
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return 1  # an index this code cannot read: leave the directory's files alone
    _remove_stale(path, keep=committed)
    return generation + 1


class _Checksummed:
    """A file being written, with the CRC-32 and length of what went through it."""

    def __init__(self, f):
        self._f, self.crc32, self.size = f, 0, 0

    def write(self, data) -> int:
        self.crc32 = zlib.crc32(data, self.crc32)
        self.size += len(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def _write_file(payload: dict, file: str) -> dict:
    """torch.save of payload to file, fsynced; returns {"size", "crc32"} for the index."""
    with open(file, "wb") as f:
        out = _Checksummed(f)
        torch.save(payload, out)
        f.flush()
        os.fsync(f.fileno())
    return {"size": out.size, "crc32": out.crc32}


def _verify_file(path: str, expected: dict | None) -> None:
    """The size and CRC-32 the index recorded for a file (checkpoints that record them)."""
    if expected is None:
        return
    size = os.path.getsize(path)
    if size != expected["size"]:
        raise ValueError(f"load_checkpoint: {path} has {size} bytes, its index recorded {expected['size']}: the file "
                         "is truncated or was replaced; load an earlier checkpoint.")
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    if crc != expected["crc32"]:
        raise ValueError(f"load_checkpoint: {path} is corrupted (its CRC-32 is {crc:#010x}, its index recorded "
                         f"{expected['crc32']:#010x}); load an earlier checkpoint.")


def _commit(path: str, index: dict) -> None:
    """Makes `index` the checkpoint in `path` with one rename (the commit point: before it the
    previous index and its files are the checkpoint, after it the new ones), then removes the files
    no index names any more (the previous generation's, and those of saves killed before their
    commit)."""
    tmp = os.path.join(path, f"{INDEX}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, INDEX))
    _fsync_dir(path)
    _remove_stale(path, keep=set(index["files"]))


def _remove_stale(path: str, keep: set) -> None:
    for name in os.listdir(path):
        if OWN_FILE.match(name) and name not in keep:
            _remove_file(os.path.join(path, name))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path: str, mmap: bool = False, checksum: dict | None = None) -> dict:
    """One file of a checkpoint, loaded with weights_only=True (tensors, numbers, strings and
    containers: nothing a checkpoint holds needs more, and nothing in it runs code), after
    checking the size and CRC-32 its index recorded. A truncated or corrupted file is refused
    naming it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_checkpoint: {path} is missing; the checkpoint is incomplete (its index names "
                                "it).")
    _verify_file(path, checksum)
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"load_checkpoint: {path} holds objects other than tensors and plain values, which a "
                         f"checkpoint never writes ({e}); it was not written by engine.save_checkpoint().") from e
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"load_checkpoint: {path} is truncated or corrupted ({type(e).__name__}: {e}); load an "
                         "earlier checkpoint.") from e


def _saved(parts, idx: int, frozen: bool) -> bool:
    """Whether a checkpoint written with `frozen` holds parameter idx."""
    return frozen or bool(parts.layout.params[idx].requires_grad)


def save(parts, model, path: str, frozen: bool = True) -> None:
    # see [Note: a save killed at any moment]
    if parts.groups.zero is not None:
        _save_sharded(parts, model, path, frozen)
        return
    path = os.path.abspath(os.fspath(path))
    opt = parts.optimizer
    payload = {
        "model": parts.access.full_state_dict(frozen=frozen),
        "optimizer": opt.state_dict() if opt is not None else None,
        "optimizer_class": opt.opt_class.__name__ if opt is not None else None,
        "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
        "engine": dataclasses.asdict(parts.counters),
        "rng": {"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if parts.device.kind == "cuda" else None},
    }
    os.makedirs(path, exist_ok=True)
    generation = _begin_generation(path)
    file = rank_file(0, generation)
    index = {"format": FORMAT, "version": VERSION, "world_size": 1, "files": [file], "generation": generation,
             "precision": parts.config.precision, "optimizer_steps": parts.counters.optimizer_steps,
             "parameters": len(parts.layout.params), "frozen": frozen}
    try:
        index["checksums"] = [_write_file(payload, os.path.join(path, file))]
    except BaseException:
        _remove_file(os.path.join(path, file))  # the previous checkpoint, if any, stays as it was
        raise
    _commit(path, index)


def _remove_file(file: str) -> None:
    try:
        os.remove(file)
    except FileNotFoundError:
        pass


def _kinds(parts, idx: int, with_state: bool | None = None) -> list[str]:
    """The value kinds of parameter idx a checkpoint carries: with the optimizer's state when the
    engine has an optimizer (unless with_state says otherwise)."""
    if with_state is None:
        with_state = parts.optimizer is not None
    return parts.layout.value_kinds(idx, with_state=with_state)


def _optimizer_common(parts):
    opt = parts.optimizer
    if opt is None:
        return None
    groups = []
    for g in opt.param_groups:
        entry = {k: v for k, v in g.items() if k != "params"}
        entry["params"] = [parts.layout.index(p) for p in g["params"]]
        groups.append(entry)
    return {"param_groups": groups, "steps": [parts.runtime.step_of(i) for i in range(len(parts.layout.params))],
            "class": opt.opt_class.__name__,
            # a generically stepped optimizer's state: whole on every rank (optim/generic.py), saved once
            "generic": opt.state_dict() if not opt.rule.native else None,
            "speculation": parts.runtime.speculation_memory() if opt.rule.native else None}


def _state_dict_keys(parts, model) -> list:
    """The model's state-dict keys in order, each with the parameter it holds (tied parameters
    appear under every key) or None for a buffer (in rank 0's "buffers"): what an exporter writes."""
    out = []
    for key, value in model.state_dict(keep_vars=True).items():
        idx = parts.layout.find(value)
        out.append([key, parts.layout.names[idx] if idx is not None else None])
    return out


def _check_optimizer_class(saved: str | None, opt, path: str) -> None:
    if saved is not None and saved != opt.opt_class.__name__:
        raise ValueError(f"load_checkpoint: {path} holds the state of a {saved} optimizer, this engine's optimizer is "
                         f"{opt.opt_class.__name__}; create the same optimizer class before loading.")


def _save_sharded(parts, model, path: str, frozen: bool) -> None:
    if parts.groups.replica_index != 0:  # HSDP: the first replica writes, the others hold the same shards
        parts.groups.barrier()
        return
    _save_zero_group(parts, model, path, frozen)
    if parts.groups.replica is not None:
        parts.groups.barrier()


def _save_zero_group(parts, model, path: str, frozen: bool) -> None:
    path = os.path.abspath(os.fspath(path))
    group, rank, world = parts.groups.zero, parts.groups.rank, parts.groups.world_size
    generation = [0]
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        generation = [_begin_generation(path)]
    dist.broadcast_object_list(generation, src=dist.get_global_rank(group, 0), group=group)
    generation = generation[0]
    own_file = os.path.join(path, rank_file(rank, generation))
    error, checksum = None, None
    try:
        tensors = {}
        for idx, name in enumerate(parts.layout.names):
            if not _saved(parts, idx, frozen):
                continue
            tensors[name] = {}
            for kind in _kinds(parts, idx):
                begin, end, value = parts.runtime.read_local(kind, idx)
                tensors[name][kind] = [begin, end, value]
        payload = {"rank": rank, "world_size": world, "tensors": tensors,
                   "rng": {"cpu": torch.get_rng_state(),
                           "cuda": torch.cuda.get_rng_state() if parts.device.kind == "cuda" else None}}
        if rank == 0:
            own = model.state_dict(keep_vars=True)
            params = {id(p) for p in parts.layout.params}
            payload["common"] = {
                "names": list(parts.layout.names),
                "buffers": {k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu().clone()
                            for k, v in own.items() if id(v) not in params},
                "optimizer": _optimizer_common(parts),
                "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
                "engine": dataclasses.asdict(parts.counters),
            }
        checksum = _write_file(payload, own_file)
    except Exception as e:  # noqa: BLE001  (every rank must learn of a failure, or the others hang)
        error = f"rank {rank}: {type(e).__name__}: {e}"
    reports = [None] * world
    dist.all_gather_object(reports, (error, checksum if error is None else None), group=group)
    errors = [e for e, _ in reports]
    failed = [e for e in errors if e is not None]
    if failed:
        _remove_file(own_file)  # the previous checkpoint, if any, stays as it was
        raise RuntimeError("save_checkpoint failed, nothing was replaced: " + "; ".join(failed))
    if rank == 0:
        index = {"format": FORMAT, "version": VERSION_SHARDED, "world_size": world, "generation": generation,
                 "files": [rank_file(r, generation) for r in range(world)], "precision": parts.config.precision,
                 "optimizer_steps": parts.counters.optimizer_steps,
                 "parameters": [{"name": name, "shape": list(parts.layout.params[i].shape),
                                 "numel": parts.layout.numels[i],
                                 "trainable": bool(parts.layout.params[i].requires_grad),
                                 "pieces": parts.layout.pieces(i, world)}
                                for i, name in enumerate(parts.layout.names) if _saved(parts, i, frozen)],
                 "frozen": frozen, "state_dict_keys": _state_dict_keys(parts, model),
                 "checksums": [c for _, c in reports]}
        _commit(path, index)
    dist.barrier(group)


def load(parts, model, path: str, model_only: bool = False) -> None:
    path = os.fspath(path)
    index_path = os.path.join(path, "index.json")
    if not os.path.isfile(index_path):
        raise FileNotFoundError(f"load_checkpoint: {index_path} does not exist; pass a directory written by "
                                "engine.save_checkpoint().")
    with open(index_path) as f:
        index = json.load(f)
    if index.get("format") != FORMAT or index.get("version") not in (VERSION, VERSION_SHARDED):
        raise ValueError(f"load_checkpoint: {path} has format {index.get('format')!r} version {index.get('version')!r};"
                         f" expected {FORMAT!r} version {VERSION} or {VERSION_SHARDED}.")
    if index["version"] == VERSION_SHARDED:
        _load_sharded(parts, model, path, index, model_only)
        return
    payload = read_file(os.path.join(path, index["files"][0]), checksum=_checksum(index, 0))
    if index.get("frozen", True):
        parts.access.load_full_state_dict(payload["model"], strict=True)
    else:  # the trainable parameters and buffers: the frozen ones stay as the model has them
        result = parts.access.load_full_state_dict(payload["model"], strict=False)
        _check_without_frozen(parts, model, path, result.missing_keys, result.unexpected_keys)
    if model_only:
        return
    opt = parts.optimizer
    if payload["optimizer"] is not None:
        if opt is None:
            raise RuntimeError("load_checkpoint: the checkpoint has optimizer state; create the optimizer with "
                               "engine.optimizer(...) before loading it.")
        _check_optimizer_class(payload.get("optimizer_class"), opt, path)
        opt.load_state_dict(payload["optimizer"])
    if payload["scaler"] is not None and parts.scaler is not None:
        parts.scaler.load_state_dict(payload["scaler"])
    _restore_counters(parts, payload["engine"])
    torch.set_rng_state(payload["rng"]["cpu"])
    if payload["rng"]["cuda"] is not None and parts.device.kind == "cuda":
        torch.cuda.set_rng_state(payload["rng"]["cuda"])


def _check_without_frozen(parts, model, path: str, missing: list, unexpected: list, by_name: bool = False) -> None:
    """A checkpoint saved with frozen=False may lack the frozen parameters only."""
    layout = parts.layout
    if by_name:
        trainable_missing = [n for n in missing if layout.params[layout.names.index(n)].requires_grad]
    else:
        own = model.state_dict(keep_vars=True)
        trainable_missing = [k for k in missing if own[k].requires_grad]
    if trainable_missing or unexpected:
        raise ValueError(f"load_checkpoint: {path} holds the trainable parameters only (saved with frozen=False), and "
                         f"they do not match this model: trainable parameters missing {trainable_missing[:5]}, "
                         f"unexpected {unexpected[:5]}; load it into the model it was saved from.")


def _checksum(index: dict, rank: int) -> dict | None:
    sums = index.get("checksums")
    return sums[rank] if sums else None


def _my_range(parts, idx: int) -> tuple[int, int]:
    """The elements of parameter idx this process holds: its shard's part, or all of it."""
    numel = parts.layout.numels[idx]
    if parts.groups.zero is None:
        return 0, numel
    mine = [p for p in parts.layout.pieces(idx, parts.groups.world_size) if p[0] == parts.groups.rank]
    return (mine[0][1], mine[0][2]) if mine else (0, 0)


def _restore_counters(parts, saved: dict) -> None:
    parts.counters.optimizer_steps = saved["optimizer_steps"]  # skipped steps: the scaler's state


def _load_sharded(parts, model, path: str, index: dict, model_only: bool) -> None:
    files = {}

    def payload(rank):
        if rank not in files:
            files[rank] = read_file(os.path.join(path, index["files"][rank]), mmap=True,
                                    checksum=_checksum(index, rank))
        return files[rank]

    saved = {p["name"]: p for p in index["parameters"]}
    names = parts.layout.names
    missing, unexpected = [n for n in names if n not in saved], [n for n in saved if n not in names]
    if not index.get("frozen", True):
        _check_without_frozen(parts, model, path, missing, unexpected, by_name=True)
        missing, unexpected = [], []
    if missing or unexpected:
        raise ValueError(f"load_checkpoint: {path} does not match this model: missing parameters {missing[:5]}, "
                         f"unexpected {unexpected[:5]}; load it into the model it was saved from.")
    common = payload(0)["common"]
    opt = None if model_only else parts.optimizer
    if common["optimizer"] is not None and opt is None and not model_only:
        raise RuntimeError("load_checkpoint: the checkpoint has optimizer state; create the optimizer with "
                           "engine.optimizer(...) before loading it.")
    if opt is not None and common["optimizer"] is not None:
        _check_optimizer_class(common["optimizer"].get("class"), opt, path)
    gm = parts.runtime
    for idx, name in enumerate(names):
        if name not in saved:
            continue  # a frozen parameter of a checkpoint saved without them (checked above)
        entry = saved[name]
        if tuple(entry["shape"]) != tuple(parts.layout.params[idx].shape):
            raise ValueError(f"load_checkpoint: parameter {name!r} has shape {tuple(entry['shape'])} in {path}, "
                             f"the model has {tuple(parts.layout.params[idx].shape)}.")
        lo, hi = _my_range(parts, idx)
        for kind in _kinds(parts, idx, with_state=opt is not None):
            full = torch.zeros(entry["numel"])  # only [lo, hi) is written: the rest is other ranks' part
            for rank, begin, end in entry["pieces"]:
                a, b = max(begin, lo), min(end, hi)
                if a >= b:
                    continue
                _, _, data = payload(rank)["tensors"][name][kind]
                full[a:b] = data[a - begin:b - begin]
            gm.write(kind, idx, full)
    if opt is not None and common["optimizer"] is not None:
        steps = common["optimizer"]["steps"]
        for idx in range(len(names)):
            if parts.layout.params[idx].requires_grad:
                gm.set_step(idx, int(steps[idx]))
        for saved_group, mine in zip(common["optimizer"]["param_groups"], opt.param_groups):
            for k, v in saved_group.items():
                if k != "params" and k in mine:
                    mine[k] = v
        if common["optimizer"].get("generic") is not None:
            opt.load_state_dict(common["optimizer"]["generic"])
        if common["optimizer"].get("speculation") is not None:
            parts.runtime.restore_speculation_memory(**common["optimizer"]["speculation"])
    own = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for key, value in common["buffers"].items():
            if key in own:
                own[key].copy_(value)
    if model_only:
        gm.synchronize()
        return
    if common["scaler"] is not None and parts.scaler is not None:
        parts.scaler.load_state_dict(common["scaler"])
    _restore_counters(parts, common["engine"])
    if index["world_size"] == parts.groups.world_size:
        rng = payload(parts.groups.rank)["rng"]
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and parts.device.kind == "cuda":
            torch.cuda.set_rng_state(rng["cuda"])
    gm.synchronize()
