"""The engine's state as each rank's share, for torch.distributed.checkpoint (DCP).

[Note: sharded state dicts]
`engine.state_dict(StateDictOptions(full_state_dict=False))` and the optimizer's
`state_dict(options)` give what `dcp.save` / `dcp.load` expect of a sharded model, in the layout
FSDP2 uses, so that a checkpoint reshards to any world size (and loads into FSDP2 or a plain
model):
- model: the model's own keys; a managed parameter is a DTensor over the ZeRO group's mesh,
  Shard(0) (torch.chunk's rows; 0-dim parameters Replicate()), holding fp32 masters (the
  parameter itself when frozen) on the CPU; buffers are plain tensors (the same on every rank,
  so DCP writes them once).
- optimizer: torch DCP's optimizer layout, keyed by parameter name: {"state": {name: {"step",
  kind: DTensor}}, "param_groups": [{hyperparameters..., "params": [names]}]}. Unlike torch's own
  optimizer state dict it has an entry for every trainable parameter, each with its step count
  (0 before its first step, for every rule), so that dcp.load into a fresh optimizer finds a
  place for everything saved and a resume is exact.
Unsharded (one process) the values are plain full tensors.

The chunk layout is not the rows' layout: a rank's shard of a chunk holds a flat range of each
parameter. Saving reads each value whole (one chunk gathered at a time, as the full state dict
does) and keeps this rank's rows, so a rank holds its share plus one parameter and one gathered
chunk; loading all-gathers each value's rows over the ZeRO group and writes this rank's flat part.
Both are collective: every rank of the group calls them, in the same order.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def options_are_sharded(options) -> bool | None:
    """None without options; else whether they ask for this rank's shards (full_state_dict=False)."""
    if options is None:
        return None
    if not (hasattr(options, "full_state_dict") and hasattr(options, "cpu_offload")):
        raise TypeError("state_dict(options): expected a StateDictOptions (torch.distributed.checkpoint.state_dict) "
                        f"or an object with full_state_dict and cpu_offload, got {type(options).__name__}.")
    return not options.full_state_dict


def _dtensor_types():
    from torch.distributed.tensor import DTensor, Replicate, Shard
    return DTensor, Replicate, Shard


def is_dtensor(value) -> bool:
    try:
        DTensor, _, _ = _dtensor_types()
    except ImportError:  # torch without DTensor: nothing can be one
        return False
    return isinstance(value, DTensor)


def _rows(dim0: int, world: int, rank: int) -> tuple[int, int]:
    """The rows [begin, end) of rank's Shard(0) piece (torch.chunk's split, as DTensor's)."""
    per = -(-dim0 // world) if dim0 else 0
    begin = min(dim0, rank * per)
    return begin, min(dim0, begin + per)


class ShardedState:
    """This rank's share of an engine's values as DTensors (see the note above). Handed the
    engine's parts (contract.EngineInternals: the manager, the layout, the process groups, the
    parameter access) and the model, for its state dict's keys."""

    def __init__(self, parts, model: torch.nn.Module):
        self._internal = parts
        self._model = model
        self._mesh = None

    @property
    def sharded(self) -> bool:
        return self._internal.groups.zero is not None

    def _device_mesh(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh
            self._mesh = DeviceMesh.from_group(self._internal.groups.zero, self._internal.groups.device.type)
        return self._mesh

    # --- values --------------------------------------------------------------------------
    def share(self, kind: str, idx: int) -> torch.Tensor:
        """Parameter idx's value of `kind` (fp32, CPU): this rank's rows as a DTensor when
        sharded (collective), the whole value otherwise."""
        gm = self._internal.runtime
        full = gm.read(kind, idx).reshape(self._internal.layout.params[idx].shape)
        if not self.sharded:
            return full
        DTensor, Replicate, Shard = _dtensor_types()
        world, rank = self._internal.groups.world_size, self._internal.groups.rank
        if full.dim() == 0:
            return DTensor.from_local(full, self._device_mesh(), [Replicate()], run_check=False)
        begin, end = _rows(full.shape[0], world, rank)
        local = full[begin:end].clone()  # its own storage: the rest of the value goes now
        return DTensor.from_local(local, self._device_mesh(), [Shard(0)], run_check=False,
                                  shape=full.shape, stride=full.stride())

    def whole(self, value, what: str) -> torch.Tensor:
        """A DTensor of share()'s layout as the whole value (fp32, CPU) on every rank
        (collective); any other tensor as it is."""
        if not is_dtensor(value):
            return value
        _, Replicate, Shard = _dtensor_types()
        placements = tuple(value.placements)
        local = value.to_local().detach()
        if placements == (Replicate(),):
            return local.float().cpu()
        if placements != (Shard(0),) or not self.sharded:
            raise ValueError(f"load_state_dict: {what} is a DTensor with placements {placements}; the engine loads "
                             "DTensors of its own sharded state dict (Shard(0) over its ranks) or full tensors. Load "
                             "through dcp.load into engine.state_dict(StateDictOptions(full_state_dict=False)).")
        shape, world = tuple(value.shape), self._internal.groups.world_size
        inner = math.prod(shape[1:])
        rows = [_rows(shape[0], world, r) for r in range(world)]
        device = self._internal.groups.device
        # rank 0's is the largest
        padded = torch.zeros((rows[0][1] - rows[0][0]) * inner, dtype=torch.float32, device=device)
        flat = local.reshape(-1).to(device=device, dtype=torch.float32)
        padded[:flat.numel()] = flat
        pieces = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(pieces, padded, group=self._internal.groups.zero)
        out = torch.cat([p[:(end - begin) * inner] for p, (begin, end) in zip(pieces, rows)])
        return out.reshape(shape).cpu()

    # --- the model ---------------------------------------------------------------------------
    def model_state_dict(self) -> dict:
        # see [Note: sharded state dicts]
        self._internal.access.absorb_writes()
        layout = self._internal.layout
        # read in the chunks' order (each gathered chunk is then read to the end before the next),
        # then put under the model's keys (tied parameters: one value under each of their keys)
        shares = [self.share("param", idx) for idx in range(len(layout.params))]
        self._internal.runtime.release_read_cache()
        out = {}
        for key, value in self._model.state_dict(keep_vars=True).items():
            idx = layout.find(value)
            if idx is None:
                v = value.detach()
                out[key] = (v.float() if v.is_floating_point() else v).cpu().clone()
            else:
                out[key] = shares[idx]
        return out

    # --- the optimizer -----------------------------------------------------------------------
    def optimizer_state_dict(self, opt) -> dict:
        """The optimizer's state in torch DCP's layout (see the note above)."""
        layout = self._internal.layout
        gm = self._internal.runtime
        kinds = layout.state_kinds
        trainable = sorted(layout.index(p) for g in opt.param_groups for p in g["params"] if p.requires_grad)
        # one kind at a time in the chunks' order: each gathered chunk is read to the end once
        values = {kind: {idx: self.share(kind, idx) for idx in trainable} for kind in kinds}
        gm.release_read_cache()
        state = {}
        if kinds or opt.rule.state_has_step:
            for idx in trainable:
                state[layout.names[idx]] = {"step": torch.tensor(float(gm.step_of(idx))),
                                            **{kind: values[kind][idx] for kind in kinds}}
        groups = []
        for g in opt.param_groups:
            names = [layout.names[layout.index(p)] for p in g["params"]]
            entry = {k: v for k, v in g.items() if k != "params"}
            entry.update(opt.rule.state_dict_extras())
            entry["params"] = names
            groups.append(entry)
        return {"state": state, "param_groups": groups}

    def load_optimizer_state(self, opt, groups: list, state: dict) -> None:
        """Writes a state of optimizer_state_dict()'s layout (names as keys) into the chunks."""
        layout = self._internal.layout
        gm = self._internal.runtime
        kinds = layout.state_kinds
        for saved, mine in zip(groups, opt.param_groups):
            names = [layout.names[layout.index(p)] for p in mine["params"]]
            if list(saved["params"]) != names:
                raise ValueError(f"optimizer.load_state_dict: a param group lists {list(saved['params'])[:3]}..., this "
                                 f"optimizer's lists {names[:3]}...; build the optimizer over the same parameters in "
                                 "the same groups.")
        for g in opt.param_groups:
            for p in g["params"]:
                if not p.requires_grad:
                    continue  # frozen: no state
                idx = layout.index(p)
                name = layout.names[idx]
                entry = state.get(name)
                if entry is None:
                    if kinds or opt.rule.state_has_step:
                        raise ValueError(f"optimizer.load_state_dict: no state for parameter {name!r}; a sharded "
                                         "optimizer state dict has an entry for every trainable parameter. Load one "
                                         "saved from optimizer.state_dict(StateDictOptions(full_state_dict=False)).")
                    continue
                missing = [kind for kind in kinds if kind not in entry]
                if missing:
                    raise ValueError(f"optimizer.load_state_dict: the state of parameter {name!r} has {sorted(entry)}, "
                                     f"{opt.opt_class.__name__} needs {list(kinds)}; load a state dict saved from the "
                                     "same optimizer class.")
                step = entry["step"] if "step" in entry else 1  # saved by torch's layout without a step
                gm.set_step(idx, int(step.item() if isinstance(step, torch.Tensor) else step))
                for kind in kinds:
                    value = self.whole(entry[kind], f"the {kind} of {name!r}")
                    gm.write(kind, idx, value.detach().reshape(-1).float().cpu())
        gm.synchronize()
