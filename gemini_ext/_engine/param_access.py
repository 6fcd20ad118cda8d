"""Parameters touched from outside the hooks: gathered(), writes absorbed, the model's own state dicts.

[Note: what a user may do to a managed parameter between steps]
- Read it. Its storage follows the chunk (csrc/torch/manager/param_storage.h): the device copy, or
  unsharded a host copy the device reads; where neither holds the whole value (sharded, not
  gathered) any access raises a RuntimeError naming the parameter and `engine.gathered`.
- Write it in place (`with torch.no_grad(): p.mul_(0.5)`, `p.copy_(x)`). The write lands in the
  16-bit copy the storage points at; torch bumps the parameter's version counter. Before anything
  could overwrite or drop that copy (the next forward, the optimizer step, a state read, a
  gather, close) `absorb_writes` moves every written value into the fp32 master and every other
  copy: an element that still equals its master rounded to the compute dtype keeps the master's
  full precision, any other element takes the written value. Writes through `p.data` bypass the
  version counter; inside `gathered(writable=True)` they are caught by comparing values.
- `engine.gathered(params, writable)`: inside, each listed parameter is an fp32 tensor on the
  compute device holding its master value, whole on every rank (read one chunk at a time:
  collective when sharded, and only the listed parameters stay on the device). They are the
  values a plain fp32 model would have, so an edit is exact; on exit with writable=True every
  parameter whose value changed is written into its master and 16-bit copies (sharded: each
  rank writes its shard of what it holds, so every rank makes the same edits, as with FSDP's
  summon_full_params), and the parameters become chunk views again. It is for reading and
  editing values between iterations, not for training steps.
- `model.state_dict()`: each managed parameter's entry is a CPU tensor of the parameter's
  original dtype holding its current value (from the fp32 master, as close() would restore it),
  tied parameters sharing one tensor; with keep_vars=True the Parameter objects themselves.
  Collective when sharded: every rank calls it. `model.load_state_dict()` writes each value
  into the master and the 16-bit copies (torch's own copy into the parameter is then a no-op;
  inside `gathered()` it also lands in the gathered tensor).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref

import torch


class ParamAccess:
    """The engine's parameters as seen from outside the hooks (see the note above). Handed the
    engine's parts (contract.EngineInternals: the manager, the layout, the configuration, the
    device, the sharded state) and the model whose state-dict hooks it registers."""

    def __init__(self, parts, model: torch.nn.Module):
        self._parts = parts
        self._model = model
        self._gm = parts.runtime
        self._layout = parts.layout
        self._params = parts.layout.params
        self._orig = parts.layout.orig  # (dtype, device) per parameter, as close() restores it
        self._dtype = parts.compute_dtype
        self._gathered_depth = 0
        self._sd_cache = (None, {})  # (weakref to the state dict being built, {index: value})
        self._handles = []
        self._gm.watch_params(list(self._params))
        for module in model.modules():
            own = [(name, i) for name, p in module._parameters.items()
                   if p is not None and (i := self._layout.find(p)) is not None]
            if not own:
                continue
            self._handles.append(module.register_state_dict_post_hook(self._state_dict_hook(own)))
            self._handles.append(module.register_load_state_dict_pre_hook(self._load_hook(own)))
        # (closures: torch marks public hooks with an attribute, which bound methods cannot take)
        self._handles.append(model.register_state_dict_post_hook(lambda *a: self._state_dict_done(*a)))
        self._handles.append(model.register_load_state_dict_post_hook(lambda *a: self._load_done(*a)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._gm.watch_params([])  # the manager lets go of the parameters
        self._gm = None  # and this object of the manager (the engine is closing)

    def before_close(self) -> None:
        """close()'s first act: refused inside engine.gathered(), whose parameters hold its copies
        until it ends (it would then bind them to a closed engine's memory); else absorb_writes."""
        if self._gathered_depth:
            raise RuntimeError("engine.close(): inside an engine.gathered() block, whose parameters hold gathered "
                               "copies until the block ends; leave the block first, then close().")
        self.absorb_writes(refuse_rebinding=False)

    # --- writes ------------------------------------------------------------------------------
    def absorb_writes(self, refuse_rebinding: bool = True) -> None:
        # see [Note: what a user may do to a managed parameter between steps]
        """Moves values written to parameters in place since the last call into the masters.
        First, parameters whose `.data` was replaced (model.half(), .to(dtype or device)) are
        given their chunk views back, and with `refuse_rebinding` that raises (see check_bindings)."""
        self.check_bindings(refuse_rebinding)
        written = self._gm.written_params()
        if not written:
            return
        with torch.no_grad():
            for i in written:
                try:
                    # a copy: on sim an fp32 parameter's .cpu() would be the chunk memory itself
                    value = self._params[i].detach().to(device="cpu", dtype=torch.float32, copy=True)
                except RuntimeError:
                    continue  # not readable here (sharded): the write itself raised
                self._write_back(i, value)
        self._gm.note_param_versions()

    def check_bindings(self, refuse: bool = True) -> None:
        # see [Note: a dtype or device change inside the block]
        """[Note: a dtype or device change inside the block] `model.half()`, `.float()`,
        `.to(dtype)`, `.to(device)` and the Trainer's `*_full_eval` casts replace each parameter's
        `.data` with a converted copy, which no chunk holds: the forward would compute from the
        stale copy while the optimizer updates the masters, and training would silently stop. The
        compute dtype and device are the engine's (GeminiConfig.precision, device), so the
        parameters get their chunk views back and this raises, naming the fix. Inside
        `gathered()` the parameters hold gathered values on purpose and are not checked."""
        if self._gathered_depth:
            return
        rebound = self._gm.rebound_params()
        if not rebound:
            return
        seen = [(self._layout.names[i], self._params[i].dtype, self._params[i].device) for i in rebound[:3]]
        views = self._gm.param_views()
        for i in rebound:
            self._params[i].data = views[i]
        named = ", ".join(f"{name!r} (now {dtype}, {device})" for name, dtype, device in seen)
        more = f" and {len(rebound) - 3} more" if len(rebound) > 3 else ""
        if not refuse:
            warnings.warn(f"gemini_ext: {len(rebound)} managed parameter(s) were converted inside the gx.enable block "
                          f"({named}{more}); the conversion was undone and close() restores each parameter's original "
                          "dtype and device from its fp32 master. Convert the model after the block.", stacklevel=4)
            return
        precision = self._parts.config.precision
        raise RuntimeError(
            f"gemini_ext: {len(rebound)} managed parameter(s) were converted inside the gx.enable block: "
            f"{named}{more}. "
            "model.half(), .float(), .bfloat16(), .to(dtype) or .to(device) replace each parameter with a copy that no "
            f"chunk holds, so training would go on from a stale copy. The engine computes in {precision} on "
            f"{self._parts.device.torch_device} from its chunks and has put the parameters back. To compute in another "
            "dtype, pass GeminiConfig(precision='bf16' | 'fp16' | 'fp32') to gx.enable; for evaluation in that dtype "
            "use torch.autocast; to move or cast the model itself, leave the block first (close() restores ordinary "
            "parameters).")

    def _write_back(self, i: int, value: torch.Tensor, only_if_changed: bool = False) -> None:
        master = self._gm.read("param", i)
        rounded = master.to(self._dtype).float()
        kept = value == rounded
        if only_if_changed and bool(kept.all()):
            return
        self._gm.write("param", i, torch.where(kept, master, value))

    # --- weights out -------------------------------------------------------------------------
    def stream(self, dtype: torch.dtype, device: torch.device):
        """(name, value) of every managed parameter, whole, in chunk order: each a copy in `dtype` on
        `device`, read from its 16-bit chunk (gathered when sharded: collective), the read cache
        released at each chunk's end, so at most one chunk's gathered copy lives beside what the
        caller keeps. Between steps only."""
        if self._gm.in_backward:
            raise RuntimeError("engine.named_parameters_for_inference(): called during backward; use it between "
                               "iterations (after optimizer.step()).")
        self.absorb_writes()
        # In the compute dtype the 16-bit copy is the value (the master rounded as each step
        # rounds it), read where it is current: on the device when resident, not the host's master.
        read = self._gm.read_compute_param_to if dtype == self._layout.compute_dtype else functools.partial(
            self._gm.read_to, "param")
        last_chunk = None
        try:
            with torch.no_grad():
                for i, (chunk, _) in enumerate(self._layout.slots):
                    if last_chunk is not None and chunk != last_chunk:
                        self._gm.release_read_cache()
                    last_chunk = chunk
                    yield self._layout.names[i], read(i, device, dtype)
        finally:
            self._gm.release_read_cache()

    # --- gathered ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self, params=None, writable: bool = False):
        indices = self._indices(params)
        if self._gathered_depth:
            raise RuntimeError("engine.gathered(): already inside a gathered block; list every parameter you need in "
                               "one call instead of nesting.")
        if self._gm.in_backward:
            raise RuntimeError("engine.gathered(): called during backward, where the hooks own the chunks; use it "
                               "between iterations (after optimizer.step() or before the forward).")
        self.absorb_writes()
        device = self._parts.device.torch_device
        views = {}
        self._gathered_depth += 1
        failed = True
        try:
            # One chunk gathered at a time (sharded), released before the block runs: what stays on
            # the device is the listed parameters' fp32 values, nothing else.
            with torch.no_grad():
                for i in indices:
                    value = self._gm.read_to("param", i, device, torch.float32)
                    views[i] = self._params[i].data
                    self._params[i].data = value
            self._gm.release_read_cache()
            yield
            failed = False
        finally:
            self._gathered_depth -= 1
            try:
                if writable and not failed:
                    with torch.no_grad():
                        for i in indices:
                            value = self._params[i].detach().to(device="cpu", dtype=torch.float32, copy=True)
                            if not torch.equal(value, self._gm.read("param", i)):
                                self._gm.write("param", i, value)
            finally:
                for i, view in views.items():
                    self._params[i].data = view
                self._gm.release_read_cache()
                self._gm.note_param_versions()

    def _indices(self, params) -> list[int]:
        if params is None:
            return list(range(len(self._params)))
        if isinstance(params, torch.Tensor):
            params = [params]
        out = []
        for p in params:
            i = self._layout.find(p)
            if i is None:
                raise ValueError("engine.gathered(params): every entry must be a parameter of the model given to "
                                 f"gx.enable; got a {type(p).__name__} of shape {tuple(getattr(p, 'shape', ()))} "
                                 "that is not one.")
            if i not in out:
                out.append(i)
        return sorted(out)

    # --- the engine's full state dicts ------------------------------------------------------
    def full_state_dict(self, frozen: bool = True, keep: bool = True) -> dict:
        """engine.state_dict(): fp32 CPU tensors under the model's keys, parameters from their
        masters; with frozen=False without the frozen parameters (buffers stay). keep=False (the
        ranks other than 0 of a rank-0-only state dict): every read is still made (they are
        collective when sharded) but dropped at once, so this rank holds one parameter and the
        gathered chunk of the reads at a time, and {} is returned."""
        self.absorb_writes()
        out = {}
        for key, value in self._model.state_dict(keep_vars=True).items():
            idx = self._layout.find(value)
            if not keep:
                if idx is not None and (frozen or value.requires_grad):
                    self._gm.read("param", idx)  # collective when sharded; the copy is dropped here
                continue
            if idx is not None:
                if frozen or value.requires_grad:
                    out[key] = self._gm.read("param", idx)
            else:
                v = value.detach()
                out[key] = (v.float() if v.is_floating_point() else v).cpu().clone()
        self._gm.release_read_cache()  # the last chunk gathered for the reads (sharded)
        return out

    def load_full_state_dict(self, state_dict: dict, strict: bool) -> object:
        """engine.load_state_dict(): masters, their 16-bit copies and buffers from a full state dict
        (or the sharded one, each DTensor gathered whole: collective)."""
        self.absorb_writes()
        own = self._model.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise RuntimeError(f"engine.load_state_dict: missing keys {missing[:5]}{'...' if len(missing) > 5 else ''},"
                               f" unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}; pass "
                               "strict=False to load the matching subset.")
        with torch.no_grad():
            for key, target in own.items():
                if key not in state_dict:
                    continue
                value = state_dict[key]
                if tuple(value.shape) == tuple(target.shape):  # a DTensor of the sharded state dict: whole
                    value = self._parts.sharded_state.whole(value, repr(key))
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(f"engine.load_state_dict: {key!r} has shape {tuple(value.shape)}, the model "
                                     f"expects {tuple(target.shape)}.")
                idx = self._layout.find(target)
                if idx is not None:
                    self._gm.write("param", idx, value.detach().float().cpu())
                else:
                    target.copy_(value)
        self._gm.synchronize()
        self._gm.note_param_versions()
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


    # --- the model's own state dicts ----------------------------------------------------------
    def _state_dict_hook(self, own: list[tuple[str, int]]):
        def hook(module, state_dict, prefix, local_metadata):
            if self._parts.closed:
                return
            cached_for, cache = self._sd_cache
            if cached_for is None or cached_for() is not state_dict:
                self.absorb_writes()
                cache = {}
                self._sd_cache = (weakref.ref(state_dict), cache)
            for name, i in own:
                key = prefix + name
                if key not in state_dict or state_dict[key] is self._params[i]:
                    continue  # keep_vars=True: the Parameter itself
                if i not in cache:
                    dtype, _ = self._orig[i]
                    cache[i] = self._gm.read("param", i).to(dtype)
                state_dict[key] = cache[i]
        return hook

    def _state_dict_done(self, module, state_dict, prefix, local_metadata) -> None:
        if self._parts.closed:
            return
        self._sd_cache = (None, {})
        self._gm.release_read_cache()  # the last chunk gathered for the reads (sharded)

    def _load_hook(self, own: list[tuple[str, int]]):
        def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
            if self._parts.closed:
                return
            self.absorb_writes()
            for name, i in own:
                key = prefix + name
                value = state_dict.get(key)
                param = self._params[i]
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(param.shape):
                    continue  # torch reports the mismatch itself
                with torch.no_grad():
                    self._gm.write("param", i, value.detach().to(device="cpu", dtype=torch.float32))
                if not self._gathered_depth:
                    state_dict[key] = param  # torch's copy of the parameter into itself does nothing
                # Inside engine.gathered() the parameter is a whole fp32 tensor: torch copies the value
                # into it too, so that the block sees it and a writable exit finds nothing to write back.
        return hook

    def _load_done(self, module, incompatible_keys) -> None:
        if not self._parts.closed:
            self._gm.note_param_versions()
