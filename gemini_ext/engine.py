"""enable() and GeminiEngine: the model's parameters live in chunks for the life of the engine.

[Note: what enable() builds] (in order: _engine/build.py)
1. The chunk layout (_engine/layout.py): parameters, tied ones once, in chunk groups that share one
   layout (the parameter, its gradient, its fp32 master and the optimizer rule's state kinds).
2. The placement policy decides, from measurements, where each chunk set's optimizer state
   lives and whether its parameter chunk's home is the host (placement/policies/; placement/placer.py gathers
   the measurements and applies the decisions).
3. The chunks are allocated and filled from the parameters' current values, the originals
   released as they are copied and given back if enable() fails (_engine/fill.py).
4. The C++ GeminiManager takes the chunk sets and binds one torch storage per parameter chunk to
   the chunk's device copy (csrc/torch/manager/param_storage.h). Each parameter, still the same Python
   object, gets `.data` = a view into its chunk storage. Buffers move to the compute device
   (_engine/buffers.py).
5. Hooks are registered (_engine/hooks.py; their bodies are C++). Parameters touched from outside the
   hooks are served by _engine/param_access.py; _engine/guards.py catches foreign optimizers and torch's
   clipping on managed parameters while the engine is open.
The iteration boundary is `end_iteration()`, which the optimizer's step calls: the access trace
closes, the MemoryTracer (placement/tracer.py) records the iteration and the policy may re-place.
Closing (or leaving the `with` block) gives every parameter back an ordinary tensor of its
original dtype and device holding the current fp32 master value (_engine/restore.py), restores
buffers, removes the hooks and frees the chunk pools.

The parts live in `engine.internal` (_engine/parts.py); the engine's other modules (optim,
checkpoint, clipping, the generic rule) get them from the registry (_engine/registry.py) and use
them through the EngineInternals Protocol (_engine/contract.py). This class is the user's API.
"""

from __future__ import annotations

import contextlib

import torch

from . import checkpoint
from ._native import _C
from ._engine import generation, guards, lanes, registry, restore
from ._engine.build import build_parts
from ._engine.out_of_memory import out_of_memory_notes
from ._engine.sharded_state import options_are_sharded
from .config import GeminiConfig
from .optim.rules import MAX_STATE_KINDS

class GeminiEngine:
    """Owns the chunks and hooks of one model; see enable()."""

    def __init__(self, model: torch.nn.Module, config: GeminiConfig, process_group=None, param_init_fn=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"enable(model): expected a torch.nn.Module, got {type(model).__name__}.")
        registry.check_unmanaged(model)
        self.model = model
        self.config = config
        # What the engine is made of, as its parts see it (_engine/contract.py); the rest of this
        # class is the user's API over it.
        self.internal = build_parts(model, config, process_group, param_init_fn, MAX_STATE_KINDS)
        self.chunk_size = self.internal.chunk_size
        registry.register(model, self, self.internal)
        guards.engine_opened(self)  # foreign optimizers and torch's clipping see managed parameters (_engine/guards.py)

    # --- where and over whom ----------------------------------------------------------------
    @property
    def device_kind(self) -> str:
        return self.internal.device.kind

    @property
    def compute_device(self) -> torch.device:
        return self.internal.device.torch_device

    @property
    def process_group(self):
        """The ZeRO group chunks are sharded over (None for one process)."""
        return self.internal.groups.zero

    @property
    def replica_group(self):
        return self.internal.groups.replica

    @property
    def replica_index(self) -> int:
        return self.internal.groups.replica_index

    @property
    def world_size(self) -> int:
        return self.internal.groups.world_size

    @property
    def rank(self) -> int:
        return self.internal.groups.rank

    @property
    def policy(self):
        return self.internal.placer.policy

    # --- parameters --------------------------------------------------------------------------
    @property
    def num_parameters(self) -> int:
        return len(self.internal.layout.params)

    def parameters(self):
        """The managed parameters (each shared parameter once), in chunk order."""
        return list(self.internal.layout.params)

    def find_parameter(self, param) -> int | None:
        """The index of `param` among the managed parameters, or None if this engine does not manage it."""
        return self.internal.layout.find(param)

    def parameter_index(self, param) -> int:
        return self.internal.layout.index(param)

    def parameter_slot(self, param) -> tuple[int, int]:
        """(chunk id, slot index) of `param`'s 16-bit (compute dtype) copy."""
        return self.internal.layout.slots[self.parameter_index(param)]

    def parameter_name(self, index: int) -> str:
        return self.internal.layout.names[index]

    def parameter_numel(self, index: int) -> int:
        return self.internal.layout.numels[index]

    # --- training ----------------------------------------------------------------------------
    def optimizer(self, cls, params=None, **kwargs):
        """A GeminiOptimizer (Adam or AdamW semantics) over the fp32 master chunks."""
        self.internal.check_open("optimizer")
        from .optim import GeminiOptimizer  # optim builds on this module, not the other way round
        return GeminiOptimizer(self, cls, params, **kwargs)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """loss.backward(**kwargs); under fp16 the loss is multiplied by the loss scale here, so it
        may be computed from any tensor, not only from the model's outputs
        (_engine/loss_scale_boundary.py)."""
        self.internal.check_open("backward")
        with self.scale_loss(loss) as scaled:
            scaled.backward(**kwargs)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor):
        """`with engine.scale_loss(loss) as scaled: scaled.backward()`: under fp16 `scaled` is the
        loss times the current loss scale and the engine's own scaling at the model's outputs stands
        aside for that backward (the form for a loss that does not come from the model's outputs,
        and for frameworks that run backward themselves); otherwise `scaled` is `loss`."""
        self.internal.check_open("scale_loss")
        boundary = self.internal.loss_scale
        if boundary is None:
            yield loss
            return
        with boundary.caller_scales() as scale:
            yield loss * scale

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside keep their gradients on the device and do
        not send them to the optimizer's tier; the first backward outside (or the step) does."""
        self.internal.check_open("no_sync")
        self.internal.placer.note_accumulation()
        previous = self.internal.runtime.no_sync
        self.internal.runtime.set_no_sync(True)
        try:
            yield
        finally:
            self.internal.runtime.set_no_sync(previous)

    def zero_grad(self) -> None:
        """Clears every gradient chunk (optimizer.zero_grad() and model.zero_grad() call it)."""
        self.internal.check_open("zero_grad")
        self.internal.zero_grad()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach=None) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over every gradient of the model: returns the total norm
        (before clipping) and clips exactly as torch does, folded into the next step's gradient
        factor (see _engine/clipping.py). Call it after the last backward, before optimizer.step().
        `foreach` is accepted for torch's signature and changes nothing."""
        self.internal.check_open("clip_grad_norm_")
        return self.internal.clipper.clip(max_norm, norm_type, error_if_nonfinite)

    def gathered(self, params=None, writable: bool = False):
        """`with engine.gathered(params=None, writable=False):` the listed parameters (default all)
        whole and current on the compute device, their chunks held there until the block ends;
        with writable=True, in-place edits made inside reach the fp32 masters on exit. Collective
        when sharded: every rank enters with the same list (see _engine/param_access.py)."""
        self.internal.check_open("gathered")
        return self.internal.access.gathered(params, writable)

    def grad(self, param) -> torch.Tensor | None:
        """The accumulated gradient of `param` (fp32, CPU) as it is in its chunk, or None."""
        self.internal.check_open("grad")
        idx = self.parameter_index(param)
        if not param.requires_grad or not self.internal.runtime.has_grad(idx):
            return None
        return self.internal.runtime.read_grad(idx)

    def synchronize(self) -> None:
        """Waits for every CPU optimizer step still running (overlap_optimizer) and for the device.
        Afterwards a parameter read outside the hooks holds the last step's values wherever its
        chunk is on the device (the next forward, state_dict() and checkpoints do this themselves)."""
        self.internal.check_open("synchronize")
        self.internal.runtime.synchronize()

    # --- phases: the device given up between training phases --------------------------------
    def offload_states(self, include=None, non_blocking: bool = False) -> dict:
        """Moves what the engine holds on the device (parameter, gradient and optimizer chunks, the
        pools' free blocks) to the host, so another phase (generation by an inference engine) has
        the device; `include`: DeepSpeed's state names ("optim_states", "hp_params", "lp_grads",
        "lp_params"; None: all). Training needs reload_states() first
        (see [Note: offloading the states], _engine/phases.py). `non_blocking`: DeepSpeed's; the move is
        complete on return. Returns what moved, and what the host could not take (`kept_on_device`)."""
        self.internal.check_open("offload_states")
        return self.internal.phases.offload(include)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Brings back what offload_states() moved; training continues bit-identically."""
        self.internal.check_open("reload_states")
        self.internal.phases.reload()

    @contextlib.contextmanager
    def states_offloaded(self, include=None):
        """`with engine.states_offloaded(): ...` offloads for the block and reloads after it."""
        self.offload_states(include)
        try:
            yield self
        finally:
            self.reload_states()

    @contextlib.contextmanager
    def generating(self, kv_cache_bytes: int | None = None, *, batch_size: int | None = None,
                   max_length: int | None = None):
        """`with engine.generating(batch_size=8, max_length=1024): model.generate(...)`: the model in
        eval mode for the block, and the device room its KV cache needs taken from the chunks'
        budget (see [Note: room for the KV cache], _engine/generation.py). The room is
        `kv_cache_bytes`, or what the model's config gives for `batch_size` sequences of `max_length`
        tokens (prompt included) in the compute dtype. Yields the room and the chunks' budget."""
        self.internal.check_open("generating")
        if kv_cache_bytes is None:
            if batch_size is None or max_length is None:
                raise ValueError("engine.generating(): pass kv_cache_bytes=, or batch_size= and max_length= (the "
                                 "sequences generated at once and their longest length, prompt included).")
            config = getattr(self.model, "config", None)
            kv_cache_bytes = generation.kv_cache_bytes(config, batch_size, max_length,
                                                       self.internal.compute_dtype.itemsize)
        was_training = self.model.training
        with self.internal.generation.held(int(kv_cache_bytes)) as held:
            self.model.eval()
            try:
                yield held
            finally:
                self.model.train(was_training)

    def named_parameters_for_inference(self, dtype: torch.dtype = torch.bfloat16, device=None):
        """Yields (name, tensor) for every parameter, whole and current, in the model's own names (a
        shared parameter once), chunk by chunk: for a colocated inference engine to load after each
        update (vLLM's `load_weights`). Each tensor is a copy in `dtype` on `device` (default: the
        compute device); at most one chunk's gathered copy lives beside what the caller keeps.
        Collective when sharded: every rank iterates to the end. Between optimizer steps."""
        self.internal.check_open("named_parameters_for_inference")
        self.internal.phases.check_resident("engine.named_parameters_for_inference()")
        target = self.compute_device if device is None else torch.device(device)
        return self.internal.access.stream(dtype, target)

    # --- for gemini_ext's own modules -------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.internal.closed

    @property
    def attached_optimizer(self):
        """The engine's optimizer, or None before engine.optimizer()."""
        return self.internal.optimizer

    # --- state -------------------------------------------------------------------------------
    def state_dict(self, options=None) -> dict:
        """The full model state: fp32 tensors on the CPU under the model's own keys (trainable
        parameters from their fp32 masters), on every rank (collective when sharded).

        `options`: torch's StateDictOptions (or anything with `full_state_dict`, `cpu_offload`).
        full_state_dict=True with cpu_offload=True is rank 0 only, as in torch: the data-parallel
        group's first rank gets the dictionary, streamed parameter by parameter, and every other
        rank {} holding one gathered chunk at a time; cpu_offload=False gives every rank all of it.
        full_state_dict=False gives this rank's share for torch.distributed.checkpoint: DTensors
        (Shard(0) over the ZeRO group) of the fp32 masters, plain tensors unsharded (see
        _engine/sharded_state.py); load_state_dict() takes it back after dcp.load."""
        self.internal.check_open("state_dict")
        sharded = options_are_sharded(options)
        if sharded is None:
            return self.internal.access.full_state_dict()
        if sharded:
            return self.internal.sharded_state.model_state_dict()
        rank0_only = bool(options.cpu_offload) and self.process_group is not None
        first = self.rank == 0 and self.replica_index == 0  # the data-parallel group's rank 0
        return self.internal.access.full_state_dict(keep=not rank0_only or first)

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Loads a state dict into the chunks (masters, their 16-bit copies, buffers): a full one,
        or the sharded one of state_dict(StateDictOptions(full_state_dict=False)) after dcp.load
        (collective when sharded)."""
        self.internal.check_open("load_state_dict")
        return self.internal.access.load_full_state_dict(state_dict, strict)

    def save_checkpoint(self, path: str, *, frozen: bool = True) -> None:
        """Model masters, optimizer, loss scaler, step counts and RNG states (see checkpoint.py).
        frozen=False leaves out the frozen parameters (a LoRA run's base model: the checkpoint is
        the adapter and its optimizer state); loading it leaves the model's frozen parameters as
        they are, so load the base first (e.g. from_pretrained)."""
        self.internal.check_open("save_checkpoint")
        self.internal.access.absorb_writes()
        checkpoint.save(self.internal, self.model, path, frozen=frozen)

    def load_checkpoint(self, path: str, *, model_only: bool = False) -> None:
        """Everything save_checkpoint wrote; with model_only=True the model alone (masters and
        buffers: for evaluation, without an optimizer), leaving optimizer, scaler, counters and RNG."""
        self.internal.check_open("load_checkpoint")
        self.internal.access.absorb_writes()
        checkpoint.load(self.internal, self.model, path, model_only=model_only)
        self.internal.runtime.note_param_versions()

    # --- observing ---------------------------------------------------------------------------
    def chunk_info(self, chunk_id: int) -> dict:
        return self.internal.chunks.chunk_info(chunk_id)

    def memory_timeline(self) -> dict:
        """Scheduling events (fetch 'F', prefetch 'P', evict 'E', iteration end 'S') with the chunk
        bytes on the device after each, and the per-iteration figures of stats()["steps"]."""
        self.internal.check_open("memory_timeline")
        return self.internal.tracer.timeline()

    def stats(self) -> dict:
        """Chunk layout, bytes per tier, traffic and counters so far; after close(), as of the close."""
        parts = self.internal
        if parts.closed:
            return self._stats_at_close
        out = {
            "device": self.device_kind,
            "precision": self.config.precision,
            "num_param_chunks": len(parts.layout.sets),
            "chunk_size": self.chunk_size,
            "wasted_bytes": parts.layout.param_wasted_bytes,  # padding of the parameter chunks
            "parameters": parts.layout.parameter_costs(),  # elements and bytes, trainable and frozen
            **parts.tracer.stats(),
            "optimizer_steps": parts.counters.optimizer_steps,
            "skipped_steps": parts.scaler.skipped_steps if parts.scaler is not None else 0,
            "loss_scale": parts.scaler.scale if parts.scaler is not None else None,
            "setup_seconds": {"total": parts.setup_seconds, **parts.setup_phases},
            "setup_fill_seconds": dict(parts.setup_fill_parts),  # the fill phase in parts
            "distributed": parts.groups.summary(),
            "placement": parts.placer.summary(parts.runtime),
            "throughput": parts.throughput.summary(),  # tokens/s and MFU (see _engine/throughput.py)
            "activations": parts.activations.stats() if parts.activations is not None else {
                "checkpointing": None, "offload": None, "plan": None, "torch_cap_bytes": None, "warm_up": None},
        }
        if parts.optimizer is not None:
            out["last_step"] = parts.optimizer.last_step_stats()
            out["lanes"] = lanes.summary(parts.tracer.steps, parts.placer.last_settled_step(), out["throughput"],
                                         out["placement"]["decision"], parts.counters.step_call_seconds)
            out["speculation"] = parts.optimizer.speculation_summary()  # the host steps started in backward
        return out

    # --- closing -----------------------------------------------------------------------------
    def close(self) -> None:
        """Restores ordinary parameters holding the current values and frees the chunks (idempotent)."""
        parts = self.internal
        if parts.closed:
            return
        parts.access.before_close()  # writes since the last step reach the masters first; not inside gathered()
        parts.runtime.stop_reclaiming()  # memory pressure no longer reaches this engine's chunks
        parts.runtime.synchronize()
        self._stats_at_close = self.stats()
        self._restorer = restore.ModelRestorer(parts.runtime, parts.chunks, parts.layout, parts.groups, parts.device)
        spares = parts.optimizer.release_spares if parts.optimizer is not None else (lambda: None)
        restored, staged = self._restorer.restore(spares)
        self._release_engine()
        self._close_staged_params = self._restorer.staged_params  # for tests and logs
        if restored and staged:
            self._restorer.move_staged_params(staged)
        self._close_params_left_on_host = self._restorer.params_left_on_host

    def _release_engine(self) -> None:
        """The end of close(): buffers back to their dtype and device, hooks off, and the chunks
        freed with the engine's last references to the manager."""
        parts = self.internal
        parts.buffers.restore()
        parts.hooks.remove()
        parts.access.remove()
        parts.throughput.remove()
        if parts.activations is not None:
            parts.activations.remove()
        parts.phases.detach()
        parts.generation.detach()
        parts.hooks.gm = None  # the manager (and every chunk) goes with the engine's references below
        parts.closed = True
        guards.engine_closed(self)
        registry.unregister(self.model, self)
        parts.tracer.detach()
        if getattr(self, "_restorer", None) is not None:
            self._restorer.detach()
        del parts.runtime  # unbinds the parameter storages; then the pools go
        del parts.chunks

    def __enter__(self) -> "GeminiEngine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, (torch.OutOfMemoryError, _C.OutOfMemoryError)):
            for note in out_of_memory_notes(exc, self.internal, self.config):
                exc.add_note(note)
        self.close()


def enable(model: torch.nn.Module, config: GeminiConfig | None = None, *, process_group=None, param_init_fn=None,
           **overrides) -> GeminiEngine:
    """Places `model`'s parameters in chunks; use as `with gx.enable(model, cfg) as engine:`.

    A model built under `torch.device("meta")` gets storage on the compute device one module
    group at a time as its values go into chunks (see gemini_ext/_engine/materialize.py):
    `param_init_fn(module)` initialises each module that owns meta tensors (default: the module's
    reset_parameters())."""
    if config is not None and not isinstance(config, GeminiConfig):
        raise TypeError(f"enable(config=...): expected a GeminiConfig, got {type(config).__name__}.")
    config = config or GeminiConfig()
    if overrides:
        config = config.replace(**overrides)
    return GeminiEngine(model, config, process_group, param_init_fn)
