"""`python -m gemini_ext export CKPT OUT`: safetensors from a checkpoint of any format.

[Note: streaming the export]
A checkpoint of a model larger than the machine's memory must still export on it. The output is
written as safetensors (a JSON header of names, dtypes, shapes and byte offsets, then the raw
bytes): every shape and dtype is known from the checkpoint's index before any value is read, so
the header goes first and then one tensor at a time is assembled, converted and appended. The
checkpoint's files are opened memory-mapped, so a tensor's pieces are read from disk when it is
assembled and nothing else stays in anonymous memory: the peak is about the largest tensor (and
its converted copy), not the model. safetensors' Python API writes whole dicts only, hence the
header written here, in its documented format; reading back uses safetensors itself.
- Format 1 (one process): the full state dict of `rank00000.pt`, memory-mapped, key by key.
- Format 2 (sharded, any world size): each parameter from its pieces in the ranks' files (the
  index says which), tied parameters under every key of the model, buffers from rank 0's file.
With `config` the output is a HuggingFace-style directory: `model.safetensors` beside a copy of
`config.json` (and the metadata `format: pt` that `from_pretrained` expects). With
`max_shard_size` the tensors, in the model's order, are cut into shards of at most that many
bytes (`model-00001-of-0000N.safetensors`, ...) and `model.safetensors.index.json` maps every key
to its shard, as transformers writes them; the peak memory stays one tensor, whatever the shard size.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import torch
from tqdm import tqdm

from ._units import parse_bytes
from .checkpoint import FORMAT, VERSION, VERSION_SHARDED, read_file

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def anon_rss_bytes() -> int | None:
    """This process's anonymous resident memory (file-backed, memory-mapped pages not counted)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class _Source:
    """The tensors of a checkpoint directory, by state-dict key, read on demand."""

    def __init__(self, path: str):
        index_path = os.path.join(path, "index.json")
        if not os.path.isfile(index_path):
            raise FileNotFoundError(f"export: {index_path} does not exist; pass a directory written by "
                                    "engine.save_checkpoint().")
        with open(index_path) as f:
            self.index = json.load(f)
        if self.index.get("format") != FORMAT or self.index.get("version") not in (VERSION, VERSION_SHARDED):
            raise ValueError(f"export: {path} has format {self.index.get('format')!r} version "
                             f"{self.index.get('version')!r}; expected {FORMAT!r} version {VERSION} or "
                             f"{VERSION_SHARDED}.")
        if not self.index.get("frozen", True):
            raise ValueError(f"export: {path} holds the trainable parameters only (saved with frozen=False, e.g. a "
                             "LoRA adapter without its base); export a checkpoint saved with frozen=True, or save "
                             "the adapter with the PEFT model's save_pretrained().")
        self.path = path
        self._files = {}
        if self.index["version"] == VERSION:
            self._model = self._file(0)["model"]
            self.entries = [(key, tuple(v.shape), v.dtype) for key, v in self._model.items()]
            return
        self._params = {p["name"]: p for p in self.index["parameters"]}
        self._buffers = self._file(0)["common"]["buffers"]
        keys = self.index.get("state_dict_keys") or ([[n, n] for n in self._params] +
                                                     [[k, None] for k in self._buffers])
        self._keys = dict((k, src) for k, src in keys)
        self.entries = []
        for key, src in keys:
            if src is None:
                self.entries.append((key, tuple(self._buffers[key].shape), self._buffers[key].dtype))
            else:
                self.entries.append((key, tuple(self._params[src]["shape"]), torch.float32))

    def _file(self, rank: int) -> dict:
        if rank not in self._files:
            sums = self.index.get("checksums")
            self._files[rank] = read_file(os.path.join(self.path, self.index["files"][rank]), mmap=True,
                                          checksum=sums[rank] if sums else None)
        return self._files[rank]

    def tensor(self, key: str) -> torch.Tensor:
        if self.index["version"] == VERSION:
            return self._model[key]
        src = self._keys[key]
        if src is None:
            return self._buffers[key]
        entry = self._params[src]
        full = torch.empty(entry["numel"], dtype=torch.float32)
        for rank, begin, end in entry["pieces"]:
            piece_begin, _, data = self._file(rank)["tensors"][src]["param"]
            full[begin:end] = data[begin - piece_begin:end - piece_begin]
        return full.view(entry["shape"])


def _config_file(config: str) -> str:
    """`config`, a config.json or a directory holding one (a from_pretrained directory)."""
    if os.path.isdir(config):
        inner = os.path.join(config, "config.json")
        if not os.path.isfile(inner):
            raise FileNotFoundError(f"export --config: the directory {config!r} has no config.json; pass the "
                                    "model's config.json or the directory that holds it.")
        return inner
    if not os.path.isfile(config):
        raise FileNotFoundError(f"export --config: {config!r} does not exist; pass the model's config.json or the "
                                "directory that holds it.")
    return config


def check_config_matches(config: str, entries: list) -> None:
    """Raises ValueError when the model `config` describes (built on meta with transformers) has
    other state-dict keys or shapes than the checkpoint: from_pretrained would not load the export.
    Without transformers the check is skipped (the copy of config.json is all that needs it)."""
    try:
        import transformers
    except ImportError:
        return
    cfg = transformers.AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(config)))
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        except ValueError:  # not a causal LM: the architecture's base model
            model = transformers.AutoModel.from_config(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    saved = {key: tuple(shape) for key, shape, _ in entries}
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    shapes = [f"{k}: {saved[k]} saved, {expected[k]} in the config" for k in expected
              if k in saved and saved[k] != expected[k]]
    if missing or unexpected or shapes:
        def first(names):
            return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        found = [f"{len(missing)} key(s) of the config's model missing ({first(missing)})" if missing else "",
                 f"{len(unexpected)} key(s) the config's model does not have ({first(unexpected)})"
                 if unexpected else "",
                 f"{len(shapes)} shape(s) differ ({first(shapes)})" if shapes else ""]
        raise ValueError(f"export: the checkpoint does not match {config} ({type(model).__name__}): "
                         + "; ".join(f for f in found if f) + ". Pass the config.json of the model that was trained "
                         "(a model wrapped at training time, e.g. by PEFT, saves under other keys).")


INDEX_NAME = "model.safetensors.index.json"  # the name transformers' from_pretrained looks for


def _shard_plan(plan: list, max_shard_bytes: int | None) -> list[list]:
    """The tensors (key, shape, dtype, bytes) in their order, cut into consecutive shards of at most
    max_shard_bytes each (a tensor larger than that is a shard of its own), as transformers'
    save_pretrained does."""
    shards, size = [[]], 0
    for entry in plan:
        nbytes = entry[3]
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _write_safetensors(path: str, entries: list, src: "_Source", bar, peak: int) -> int:
    """One safetensors file of `entries` [(key, shape, dtype, nbytes)], header first, then one
    tensor at a time (see the note above), written to a temporary name and renamed; returns the
    peak anonymous memory seen."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, shape, out_dtype, nbytes in entries:
        header[key] = {"dtype": SAFETENSORS_DTYPES[out_dtype], "shape": list(shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for key, _, out_dtype, nbytes in entries:
                value = src.tensor(key).to(out_dtype).contiguous()
                f.write(value.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no copy
                peak = max(peak, anon_rss_bytes() or 0)  # while the tensor is still held
                del value
                bar.update(nbytes)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return peak


def export(checkpoint: str, out: str, dtype: str = "fp32", config: str | None = None,
           progress: bool = True, max_shard_size: int | str | None = None) -> dict:
    # see [Note: streaming the export]
    """Writes the model of `checkpoint` as safetensors (see the note above): one file `out`, or
    with `config` or `max_shard_size` a directory `out` in the layout transformers'
    `save_pretrained` writes (`model.safetensors`, or shards `model-0000k-of-0000N.safetensors`
    of at most max_shard_size bytes each, e.g. "5GB", with `model.safetensors.index.json`).
    Returns {"path" (the file, or the index when sharded), "files", "tensors", "bytes",
    "peak_anon_bytes" (the most anonymous memory seen after each tensor, this process's),
    "largest_tensor_bytes"}."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export: dtype {dtype!r}; expected one of {sorted(EXPORT_DTYPES)}.")
    max_shard_bytes = None if max_shard_size is None else parse_bytes(max_shard_size, "export: max_shard_size")
    target = EXPORT_DTYPES[dtype]
    src = _Source(checkpoint)
    if config is not None:
        config = _config_file(config)
        check_config_matches(config, src.entries)
    plan = []
    for key, shape, src_dtype in src.entries:
        out_dtype = target if src_dtype.is_floating_point else src_dtype
        if out_dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"export: {key!r} has dtype {out_dtype}, which safetensors cannot hold.")
        plan.append((key, tuple(shape), out_dtype, out_dtype.itemsize * int(torch.Size(shape).numel())))
    shards = _shard_plan(plan, max_shard_bytes)
    directory = config is not None or max_shard_bytes is not None
    if directory:
        os.makedirs(out, exist_ok=True)
        if config is not None:
            shutil.copyfile(config, os.path.join(out, "config.json"))
        names = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
        paths = [os.path.join(out, n) for n in names]
    else:
        names, paths = [os.path.basename(out)], [out]
    total = sum(e[3] for e in plan)
    peak = anon_rss_bytes() or 0
    with tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=not progress) as bar:
        for path, entries in zip(paths, shards):
            peak = _write_safetensors(path, entries, src, bar, peak)
    path = paths[0]
    if len(shards) > 1:  # the index last: a reader finds it only once every shard it names is in place
        index = {"metadata": {"total_size": total},
                 "weight_map": {e[0]: name for name, entries in zip(names, shards) for e in entries}}
        path = os.path.join(out, INDEX_NAME)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(index, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return {"path": path, "files": paths, "tensors": len(plan), "bytes": total, "peak_anon_bytes": peak,
            "largest_tensor_bytes": max((e[3] for e in plan), default=0)}
