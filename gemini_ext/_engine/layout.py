"""The chunk layout of one model: which chunk and slot holds each parameter and its companions.

[Note: the layout]
Parameters (tied ones once) are registered, in definition order, into chunk groups that share one
layout: `param` (the compute dtype of `precision`), `grad` (same dtype), `master` (fp32; absent
for fp32 precision, where the parameter chunk is the master) and `state0`, `state1` (fp32): room
for the optimizer's state. The optimizer is created after enable(), so the state groups are laid
out for the native rule with the most state kinds (Adam: two) but get memory only when an
optimizer is attached, and only for its rule's kinds (`bind_states`: SGD with momentum and Lion
use one, plain SGD and generically stepped optimizers none). Frozen parameters (requires_grad=False
at enable) go to a `frozen` group without companions, where the compute dtype holds their values
exactly; the others (fp32 parameters under bf16 or fp16) go to `frozen_wide` with an fp32
companion `frozen_master` in pageable host memory (its chunk set's master: never stepped, it is what state
dicts, checkpoints and close() read, and writes reach both), so that a frozen parameter comes
back from the engine bit for bit as it went in. Every group starts on the host. The k-th
chunk of every group forms chunk set k: the unit that placement decides and the optimizer steps.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from .._native import _C
from .._units import format_bytes
from ..placement.costs import STATE_DTYPE, set_bytes_per_element
from ..search import ALIGNMENT_NUMEL, search_chunk_configuration, wider_search

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CHUNK_SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # parameter dtypes enable() takes
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # GeminiConfig.optimizer_state_dtype
FROZEN_KINDS = ("frozen",)                         # frozen parameters the compute dtype holds exactly
FROZEN_WIDE_KINDS = ("frozen_wide", "frozen_master")  # the others, with their exact values beside


def held_exactly(orig: torch.dtype, chunk: torch.dtype) -> bool:
    """Whether a chunk of dtype `chunk` represents every value of dtype `orig` exactly."""
    return orig == chunk or (chunk == torch.float32 and orig in (torch.bfloat16, torch.float16))


def choose_chunk_size(model, named, config, world_size: int) -> int:
    """The chunk size in elements: the config's, else the search's (warning when a wider search
    range would waste much less)."""
    chunk_cfg = config.chunk_config_for(world_size)
    if chunk_cfg is not None:
        return chunk_cfg["chunk_size"]
    found = search_chunk_configuration(model, config.search_range_m, config.min_chunk_size_m,
                                       precision=config.precision)
    chunk_size = found["chunk_size"]
    wider = wider_search(model, found, config.search_range_m, config.min_chunk_size_m, config.precision)
    if wider is not None:
        wider_range, better = wider
        warnings.warn(
            f"gemini_ext: the chunk search over search_range_m={config.search_range_m:g} found chunks of "
            f"{chunk_size:,} elements that waste {format_bytes(found['wasted_bytes'])} "
            f"({found['wasted_frac']:.1%}) of the parameter chunks, and the same fraction of every gradient "
            f"and optimizer-state chunk; search_range_m={wider_range:g} finds {better['chunk_size']:,} "
            f"elements, wasting {better['wasted_frac']:.1%}. Pass search_range_m={wider_range:g} (or a "
            "chunk_config_dict) to use that memory.", stacklevel=4)
    return _fitted(chunk_size, named)  # a model smaller than the minimum chunk size needs no larger chunk


def _fitted(chunk_size: int, named) -> int:
    """`chunk_size`, or the aligned elements of `named` when they are fewer."""
    return min(chunk_size, sum(-(-p.numel() // ALIGNMENT_NUMEL) * ALIGNMENT_NUMEL for _, p in named))


def check_parameters(model, named, config, compute_dtype: torch.dtype) -> None:
    if not named:
        raise ValueError(f"enable(): {type(model).__name__} has no parameters to place in chunks.")
    for name, p in named:
        if p.dtype not in CHUNK_SOURCE_DTYPES:
            raise TypeError(f"enable(): parameter {name!r} has dtype {p.dtype}; gemini_ext trains float32, "
                            "bfloat16 and float16 parameters (fp32 masters, compute in `precision`), so a "
                            f"{p.dtype} parameter would silently lose precision or meaning. Convert the model "
                            "first (model.float()), or make a non-trainable tensor a buffer.")
    narrower = sorted({str(p.dtype) for _, p in named if p.dtype.itemsize < compute_dtype.itemsize})
    if narrower:
        warnings.warn(f"gemini_ext: the model has {', '.join(narrower)} parameters and precision="
                      f"{config.precision!r}: the fp32 masters start from those values (exactly), training "
                      f"computes in {compute_dtype}, and close() gives the parameters back in their own "
                      "dtype, rounded from the masters.", stacklevel=4)


@dataclasses.dataclass
class SetChunks:
    """The chunk ids of one chunk set (-1: absent)."""
    param: int
    grad: int = -1
    master: int = -1
    state_slots: tuple = ()  # the state groups' chunks, with or without memory
    states: dict = dataclasses.field(default_factory=dict)  # state kind -> chunk id, once an optimizer is attached

    @property
    def trainable(self) -> bool:
        return self.grad >= 0

    def optimizer_side(self) -> dict:
        """{kind: chunk id} of the gradient, the master and the state chunks that exist."""
        out = {"grad": self.grad, "master": self.master, **self.states}
        return {k: c for k, c in out.items() if c >= 0}


class ChunkLayout:
    """Registers a model's parameters into chunk groups (see the note above) and answers where
    each one lives. Built on a ChunkManager whose chunks are closed before anything is allocated."""

    def __init__(self, chunks, named: list, compute_dtype: torch.dtype, compute_device: torch.device,
                 state_slots: int, chunk_size: int, state_dtype: torch.dtype = STATE_DTYPE,
                 master_weights: bool = True):
        self.compute_dtype = compute_dtype
        self.state_dtype = state_dtype  # of the optimizer state chunks (the master is fp32)
        # An fp32 master beside 16-bit parameters; without (master_weights=False) P is the master.
        self.has_master = compute_dtype != STATE_DTYPE and master_weights
        self.state_groups = tuple(f"state{k}" for k in range(state_slots))
        self.state_kinds: tuple[str, ...] = ()  # the attached optimizer's (bind_states)
        # The state kinds placement plans room for: every slot until an optimizer says otherwise.
        self.planned_state_kinds = state_slots
        self.trainable_kinds = ("param", "grad") + self.state_groups + (("master",) if self.has_master else ())
        host = chunks.host_tier
        trainable = [(n, p) for n, p in named if p.requires_grad]
        # Frozen parameters the compute dtype holds exactly, and the others (fp32 under a 16-bit
        # precision), which keep their exact value in an fp32 companion on the host.
        frozen = [(n, p) for n, p in named if not p.requires_grad and held_exactly(p.dtype, compute_dtype)]
        frozen_wide = [(n, p) for n, p in named if not p.requires_grad and not held_exactly(p.dtype, compute_dtype)]
        group_dtype = {"param": compute_dtype, "grad": compute_dtype, "frozen": compute_dtype,
                       "frozen_wide": compute_dtype, "frozen_master": STATE_DTYPE,
                       **{kind: state_dtype for kind in self.state_groups}}
        # Each group's chunks are no larger than what the group holds: a LoRA adapter's few thousand
        # trainable elements get chunks of their size, not the frozen base model's (whose gradient,
        # master and state chunks would be mostly padding).
        if trainable:
            for kind in self.trainable_kinds:
                chunks.create_group(kind, group_dtype.get(kind, STATE_DTYPE), _fitted(chunk_size, trainable), host,
                                    ALIGNMENT_NUMEL)
        for kinds, members in ((FROZEN_KINDS, frozen), (FROZEN_WIDE_KINDS, frozen_wide)):
            for kind in kinds if members else ():
                chunks.create_group(kind, group_dtype[kind], _fitted(chunk_size, members), self.home_tier(kind, host),
                                    ALIGNMENT_NUMEL)
        self.handles = {}  # (kind, parameter index) -> (chunk, slot)
        self.names, self.params, self.orig, self.numels = [], [], [], []
        self._kinds = []  # per parameter: its groups, the compute-dtype one first
        for name, p in trainable + frozen + frozen_wide:
            idx = len(self.params)
            self.names.append(name)
            self.params.append(p)
            self.numels.append(p.numel())
            self.orig.append((p.dtype, compute_device if p.is_meta else p.device))
            kinds = self.trainable_kinds if p.requires_grad else (
                FROZEN_KINDS if held_exactly(p.dtype, compute_dtype) else FROZEN_WIDE_KINDS)
            self._kinds.append(kinds)
            for kind in kinds:
                self.handles[(kind, idx)] = chunks.register_tensor(kind, name, p.numel(), list(p.shape))
        chunks.close_chunks()  # the layouts are known from here: plan before any memory is taken
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.sets = self._chunk_sets(chunks)
        # (chunk, slot) of each parameter's compute-dtype copy
        self.slots = [self.handles[(kinds[0], i)] for i, kinds in enumerate(self._kinds)]
        infos = {s.param: chunks.chunk_info(s.param) for s in self.sets}
        self.shard_bytes = [infos[s.param]["shard_numel"] * compute_dtype.itemsize for s in self.sets]
        # per parameter: (offset, numel) in its chunk and that chunk's shard size, for pieces()
        self._placement_in_chunk = []
        for chunk, slot in self.slots:
            _, offset, numel, _, _ = infos[chunk]["slots"][slot]
            self._placement_in_chunk.append((offset, numel, infos[chunk]["shard_numel"]))
        self.param_wasted_bytes = sum((infos[s.param]["padded_numel"] - infos[s.param]["payload_numel"])
                                      * compute_dtype.itemsize for s in self.sets)  # padding of parameter chunks
        self._set_numels = [(infos[s.param]["padded_numel"], infos[s.param]["payload_numel"]) for s in self.sets]

    def _chunk_sets(self, chunks) -> list[SetChunks]:
        # see [Note: the layout]
        """Trainable sets first (chunk order), then frozen ones."""
        def ids(kind):
            try:
                return chunks.group_chunk_ids(kind)
            except ValueError:
                return []
        sets = []
        p_ids = ids("param")
        if p_ids:
            companions = {k: ids(k) for k in ("grad",) + self.state_groups + (("master",) if self.has_master else ())}
            for k, v in companions.items():
                if len(v) != len(p_ids):
                    raise _C.InternalError(f"gemini_ext internal error (this is a bug, please report it): group {k} "
                                           f"has {len(v)} chunks, the parameter group {len(p_ids)}")
            for n, c in enumerate(p_ids):
                sets.append(SetChunks(param=c, grad=companions["grad"][n],
                                      master=companions["master"][n] if self.has_master else -1,
                                      state_slots=tuple(companions[k][n] for k in self.state_groups)))
        sets.extend(SetChunks(param=c) for c in ids("frozen"))
        sets.extend(SetChunks(param=c, master=m) for c, m in zip(ids("frozen_wide"), ids("frozen_master")))
        return sets

    def frozen_master_shard_bytes(self) -> int:
        """This rank's bytes of the frozen parameters' exact fp32 values (host only)."""
        return sum(shard // self.compute_dtype.itemsize * STATE_DTYPE.itemsize
                   for s, shard in zip(self.sets, self.shard_bytes) if not s.trainable and s.master >= 0)

    def unbound_state_chunks(self) -> list[int]:
        """The state chunks no optimizer uses yet (they are created without memory)."""
        return [c for s in self.sets for c in s.state_slots if c not in s.states.values()]

    def state_chunks_for(self, kinds: tuple[str, ...]) -> list[list[int]]:
        """Per chunk set, the chunks that would hold `kinds` (in order; none for frozen sets)."""
        if len(kinds) > len(self.state_groups):
            raise _C.InternalError(f"gemini_ext internal error (this is a bug, please report it): {len(kinds)} "
                                   f"state kinds, the layout has {len(self.state_groups)} state groups")
        return [list(s.state_slots[:len(kinds)]) if s.trainable else [] for s in self.sets]

    def bind_states(self, kinds: tuple[str, ...], planned_state_kinds: int) -> None:
        """An optimizer with these state kinds was attached (its chunks got memory)."""
        for s in self.sets:
            if s.trainable:
                s.states = dict(zip(kinds, s.state_slots))
        self.state_kinds = tuple(kinds)
        self.planned_state_kinds = planned_state_kinds

    # --- lookups -----------------------------------------------------------------------------
    def find(self, param) -> int | None:
        """The index of `param` among the managed parameters, or None if it is not one."""
        idx = self._index.get(id(param))
        return idx if idx is not None and self.params[idx] is param else None

    def index(self, param) -> int:
        idx = self.find(param)
        if idx is None:
            raise ValueError("gemini_ext: the tensor is not a parameter managed by this engine (pass parameters of "
                             "the model given to gx.enable).")
        return idx

    def set_of_param(self) -> list[int]:
        """The chunk set index of each parameter."""
        set_of_chunk = {s.param: k for k, s in enumerate(self.sets)}
        return [set_of_chunk[chunk] for chunk, _ in self.slots]

    def exact_kind(self, idx: int) -> str:
        """The group whose chunk holds parameter idx's value exactly: its fp32 master, else its
        parameter chunk (fp32 precision), or the frozen chunk."""
        if not self.params[idx].requires_grad:
            return self._kinds[idx][-1]  # "frozen", or "frozen_master" beside "frozen_wide"
        return "master" if self.has_master else "param"

    @staticmethod
    def home_tier(kind: str, host: str) -> str:
        """The host tier a group's chunks start on: `host` (pinned, where pin_memory), but the exact
        frozen values, read by state dicts and close() only, in pageable memory."""
        return "pageable_host" if kind == "frozen_master" else host

    def kinds_of(self, idx: int) -> tuple:
        """The groups holding parameter idx: its compute-dtype chunk's first."""
        return self._kinds[idx]

    def value_kinds(self, idx: int, with_state: bool) -> list[str]:
        """The value kinds of parameter idx that checkpoints and state dicts carry: "param" (its
        fp32 value) and, with an optimizer, each state kind of a trainable parameter."""
        if not self.params[idx].requires_grad or not with_state:
            return ["param"]
        return ["param", *self.state_kinds]

    def offset_in_chunk(self, idx: int) -> tuple[int, int]:
        """(offset, numel) of parameter idx in its chunk (the same in every companion)."""
        offset, numel, _ = self._placement_in_chunk[idx]
        return offset, numel

    def pieces(self, idx: int, world_size: int) -> list[list[int]]:
        """[rank, begin, end] for each rank holding elements of parameter idx (the same layout on
        every rank)."""
        offset, numel, shard = self._placement_in_chunk[idx]
        out = []
        for r in range(world_size):
            lo, hi = max(offset, r * shard), min(offset + numel, (r + 1) * shard)
            if lo < hi:
                out.append([r, lo - offset, hi - offset])
        return out

    def parameter_costs(self) -> dict:
        """What the parameters cost, trainable and frozen apart: their elements and the bytes of
        their chunk sets, each chunk counted once whatever its tier and over every rank together
        (padding included): a parameter chunk in the compute dtype; a trainable set adds its
        gradient, fp32 master and the optimizer's state kinds (the planned ones before an
        optimizer is attached). A frozen parameter costs its compute-dtype bytes, and 4 more on the host
        where the compute dtype does not hold it exactly (fp32 under a 16-bit precision)."""
        kinds = len(self.state_kinds) if self.state_kinds else self.planned_state_kinds
        per_element = set_bytes_per_element(self.compute_dtype, kinds, self.state_dtype, self.has_master)
        out = {"trainable": {"parameters": 0, "bytes": 0}, "frozen": {"parameters": 0, "bytes": 0}}
        for chunks, (padded, payload) in zip(self.sets, self._set_numels):
            entry = out["trainable" if chunks.trainable else "frozen"]
            entry["parameters"] += payload
            extra = per_element if chunks.trainable else STATE_DTYPE.itemsize if chunks.master >= 0 else 0
            entry["bytes"] += padded * (self.compute_dtype.itemsize + extra)
        for entry in out.values():
            entry["bytes_per_parameter"] = entry["bytes"] / entry["parameters"] if entry["parameters"] else 0.0
        return out

    def whole_model_bytes(self) -> int:
        """The model's parameters in their original dtypes."""
        return sum(n * dtype.itemsize for n, (dtype, _) in zip(self.numels, self.orig))
