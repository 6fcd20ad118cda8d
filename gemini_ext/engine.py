"""enable() and GeminiEngine: the model's parameters live in chunks for the life of the engine.

[Note: what enable() builds]
1. The chunk layout (_layout.py): parameters, tied ones once, in chunk groups that share one
   layout (the parameter, its gradient, its fp32 master and the optimizer rule's state kinds).
2. The placement policy decides, from measurements, where each chunk set's optimizer state
   lives and whether its parameter chunk's home is the host (policy.py; _placement.py gathers
   the measurements and applies the decisions).
3. The chunks are allocated and filled from the parameters' current values, the originals
   released as they are copied and given back if enable() fails (_fill.py).
4. The C++ GeminiManager takes the chunk sets and binds one torch storage per parameter chunk to
   the chunk's device copy (csrc/torch/param_storage.h). Each parameter, still the same Python
   object, gets `.data` = a view into its chunk storage. Buffers move to the compute device
   (_buffers.py).
5. Hooks are registered (_hooks.py; their bodies are C++). Parameters touched from outside the
   hooks are served by _param_access.py; _guards.py catches foreign optimizers and torch's
   clipping on managed parameters while the engine is open.
The iteration boundary is `end_iteration()`, which the optimizer's step calls: the access trace
closes, the MemoryTracer (_tracer.py) records the iteration and the policy may re-place.
Closing (or leaving the `with` block) gives every parameter back an ordinary tensor of its
original dtype and device holding the current fp32 master value (_restore.py), restores
buffers, removes the hooks and frees the chunk pools.

The engine's other modules (optim, checkpoint, clipping, parameter access) use the interface
under "for gemini_ext's own modules" below; users use the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings

import torch

from . import _C, _guards, _registry, _restore, allocator, checkpoint
from ._buffers import BufferPlacement
from ._clipping import GradClipper
from ._device import ComputeDevice, cuda_available, resolve_device  # noqa: F401  (re-exported)
from ._env import logger
from ._fill import ChunkFill, allocated_on_write
from ._hooks import HookSet
from ._layout import COMPUTE_DTYPES, HOST_TIERS, STATE_DTYPES, ChunkLayout, check_parameters, choose_chunk_size
from ._materialize import MetaMaterializer
from ._param_access import ParamAccess
from ._placement import Placer
from ._process_groups import DataParallelGroups, resolve_process_group
from ._rules import MAX_STATE_KINDS
from ._tracer import MemoryTracer, SetupTimer
from ._units import format_bytes
from .amp import DynamicLossScaler
from .config import GeminiConfig
from .policy import make_policy
from .search import unique_parameters


@dataclasses.dataclass
class TrainingCounters:
    optimizer_steps: int = 0
    skipped_steps: int = 0  # fp16 steps skipped for overflow


class GeminiEngine:
    """Owns the chunks and hooks of one model; see enable()."""

    def __init__(self, model: torch.nn.Module, config: GeminiConfig, process_group=None, param_init_fn=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"enable(model): expected a torch.nn.Module, got {type(model).__name__}.")
        _registry.check_unmanaged(model)
        data_parallel = resolve_process_group(process_group)
        if not config.master_weights and config.precision != "fp32":
            raise NotImplementedError(f"master_weights=False with precision={config.precision!r}: stepping 16-bit "
                                      "parameters without fp32 masters is not supported; use master_weights=True.")
        # ZeRO inside a group, replicas across groups (HSDP): chunks are sharded over the ZeRO group.
        self.groups = DataParallelGroups(data_parallel, config.extra_dp_size)
        self.model = model
        self.config = config
        self.compute_dtype = COMPUTE_DTYPES[config.precision]
        self.scaler = DynamicLossScaler.from_config(config) if config.precision == "fp16" else None
        self.counters = TrainingCounters()
        self.clipper = GradClipper(self)
        self._optimizer = None
        self._closed = False
        timer = SetupTimer()
        policy = make_policy(config)
        self.device = ComputeDevice(config)
        if self.device.is_cuda:
            self.groups.set_device(self.device.torch_device)
        named = unique_parameters(model)
        check_parameters(model, named, config, self.compute_dtype)
        self.chunk_size = choose_chunk_size(model, named, config, self.world_size)
        self.chunks = self._open_chunk_manager()
        meta = MetaMaterializer(model, self.compute_device, param_init_fn)  # empty unless built on meta
        self.layout = ChunkLayout(self.chunks, named, self.compute_dtype, self.compute_device, MAX_STATE_KINDS,
                                  self.chunk_size, STATE_DTYPES[config.optimizer_state_dtype])
        self.placer = Placer(policy, self.layout, self.device, self.groups)
        self.placer.initial()
        device_first, device_grads = self.placer.device_first_chunks()
        on_write = allocated_on_write(self.layout, device_first, self.compute_device)
        timer.done("plan")  # chunk size, layouts, placement plan
        self.chunks.finalize([c for c in device_first if c not in on_write],
                             device_grads + self.layout.unbound_state_chunks() + sorted(on_write))
        timer.done("allocate")  # every chunk's first copy, zeroed
        fill = ChunkFill(self.layout, self.chunks, self.groups, self.device, meta)
        try:
            fill.run(set(device_first), on_write)
            self.setup_fill_parts = fill.parts
            timer.done("fill")  # the parameters' values into chunks (materialising a meta-built model)
            self._finish_init()
            timer.done("place")  # the placement applied, parameter views, buffers, hooks
        except BaseException as exc:
            fill.rollback(exc)
            raise
        fill.commit()
        self.setup_phases = timer.phases
        self.setup_seconds = timer.total()
        self._warn_if_close_cannot_restore()
        logger.info("enable: %d parameters in %d chunks of %d elements on %s (%s wasted), %.2f s (%s)",
                    len(self.layout.params), self.chunks.num_chunks, self.chunk_size, self.device_kind,
                    format_bytes(self.chunks.wasted_bytes()), self.setup_seconds,
                    ", ".join(f"{k} {v:.2f} s" for k, v in self.setup_phases.items()))
        if logger.isEnabledFor(logging.INFO):  # /proc and the device are read only when it prints
            logger.info("enable: memory after set-up: %s", self.tracer.memory_figures())
        _guards.engine_opened(self)  # foreign optimizers and torch's clipping see managed parameters (_guards.py)

    def _open_chunk_manager(self):
        chunks = _C.ChunkManager(self.device.context, world_size=self.world_size, rank=self.rank,
                                 pin_memory=self.config.pin_memory)
        self._comm = self._replica_comm = None
        zero, replica = self.groups.zero, self.groups.replica
        if zero is not None:
            if self.device.is_cuda and torch.distributed.get_backend(zero) != "nccl":
                warnings.warn("gemini_ext: chunks on cuda with a non-NCCL process group; collectives on device "
                              "memory need a backend that supports CUDA tensors (nccl).", stacklevel=4)
            self._comm = _C.ProcessGroupCommunicator(zero, self.device.context)
            chunks.set_communicator(self._comm)
            if replica is not None:
                self._replica_comm = _C.ProcessGroupCommunicator(replica, self.device.context)
        return chunks

    def _finish_init(self) -> None:
        """The C++ runtime over the filled chunks, the placement applied, parameter views,
        buffers, hooks."""
        config, layout = self.config, self.layout
        pspecs = [(chunk, slot, bool(p.requires_grad)) for (chunk, slot), p in zip(layout.slots, layout.params)]
        self.runtime = runtime = _C.GeminiManager(self.chunks, self.placer.set_specs(), pspecs,
                                                  config.placement_policy)
        if self._replica_comm is not None:
            runtime.set_replica_communicator(self._replica_comm)
        runtime.set_device_budget(self.placer.current.device_budget_bytes)
        self.tracer = MemoryTracer(self.chunks, runtime, self.device)
        self.tracer.begin()  # per-iteration non-model peaks start here
        runtime.set_async_reduce(config.enable_async_reduce)
        runtime.set_max_prefetch(config.max_prefetch)
        runtime.set_overlap_optimizer(config.overlap_optimizer)
        if config.enable_gradient_accumulation:
            runtime.set_no_sync(True)  # gradients accumulate on the device until the step
        views = runtime.param_views()
        runtime.apply_placement()
        for tier in HOST_TIERS:  # groups that left the host give their arena back
            self.chunks.trim(tier)
        self._bind_parameters(views)
        self._buffers = BufferPlacement(self.model, self.compute_device, self.compute_dtype, config.cast_buffers,
                                        self.groups.from_rank0)
        self._hooks = HookSet(runtime, self.model, layout.params,
                              scale_fn=(lambda: self.scaler.scale) if self.scaler is not None else None,
                              on_backward_start=self._on_backward_start,
                              on_forward_start=self._on_forward_start)
        self.access = ParamAccess(self, self.model, layout.params, layout.orig, self.compute_dtype)
        _registry.register(self.model, self)

    def _bind_parameters(self, views) -> None:
        """Each parameter's .data becomes its chunk view; an existing gradient follows it into its
        gradient chunk."""
        existing = []
        for i, (p, view) in enumerate(zip(self.layout.params, views)):
            if p.grad is not None:
                if not p.requires_grad:
                    warnings.warn(f"gemini_ext: frozen parameter {self.layout.names[i]!r} has a .grad; frozen "
                                  "parameters have no gradient chunk, so it is dropped.", stacklevel=5)
                else:
                    existing.append((i, p.grad.detach()))
            p.data = view
            p.grad = None  # gradients live in chunks from now on
        if existing:
            with torch.no_grad():
                for i, g in existing:
                    p = self.layout.params[i]
                    p.grad = g.to(device=p.device, dtype=p.dtype)
                    self.runtime.post_accumulate_grad(i, p)
            self.runtime.end_backward()

    def _warn_if_close_cannot_restore(self) -> None:
        whole, room = self.layout.whole_model_bytes(), _restore.restore_room_bytes(self.chunks, self.device)
        if room is not None and whole > room:
            warnings.warn(
                f"gemini_ext: the whole model ({format_bytes(whole)} in its original dtypes) is larger than this "
                f"rank's device and host memory ({format_bytes(room)}), so leaving the `with` block cannot give it "
                "back as ordinary tensors: close() will leave the parameters empty. Keep the trained values with "
                "engine.save_checkpoint(dir) (sharded; loads at any world size) or engine.state_dict() inside the "
                "block.", stacklevel=4)

    # --- where and over whom ----------------------------------------------------------------
    @property
    def device_kind(self) -> str:
        return self.device.kind

    @property
    def compute_device(self) -> torch.device:
        return self.device.torch_device

    @property
    def process_group(self):
        """The ZeRO group chunks are sharded over (None for one process)."""
        return self.groups.zero

    @property
    def replica_group(self):
        return self.groups.replica

    @property
    def replica_index(self) -> int:
        return self.groups.replica_index

    @property
    def world_size(self) -> int:
        return self.groups.world_size

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def policy(self):
        return self.placer.policy

    # --- parameters --------------------------------------------------------------------------
    @property
    def num_parameters(self) -> int:
        return len(self.layout.params)

    def parameters(self):
        """The managed parameters (each shared parameter once), in chunk order."""
        return list(self.layout.params)

    def find_parameter(self, param) -> int | None:
        """The index of `param` among the managed parameters, or None if this engine does not manage it."""
        return self.layout.find(param)

    def parameter_index(self, param) -> int:
        return self.layout.index(param)

    def parameter_slot(self, param) -> tuple[int, int]:
        """(chunk id, slot index) of `param`'s 16-bit (compute dtype) copy."""
        return self.layout.slots[self.parameter_index(param)]

    def parameter_name(self, index: int) -> str:
        return self.layout.names[index]

    def parameter_numel(self, index: int) -> int:
        return self.layout.numels[index]

    # --- training ----------------------------------------------------------------------------
    def optimizer(self, cls, params=None, **kwargs):
        """A GeminiOptimizer (Adam or AdamW semantics) over the fp32 master chunks."""
        self.check_open("optimizer")
        from .optim import GeminiOptimizer  # optim builds on this module, not the other way round
        return GeminiOptimizer(self, cls, params, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Same as loss.backward() (the fp16 loss scale is applied by the engine's hooks)."""
        self.check_open("backward")
        loss.backward()

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside keep their gradients on the device and do
        not send them to the optimizer's tier; the first backward outside (or the step) does."""
        self.check_open("no_sync")
        self.placer.note_accumulation()
        previous = self.runtime.no_sync
        self.runtime.set_no_sync(True)
        try:
            yield
        finally:
            self.runtime.set_no_sync(previous)

    def zero_grad(self) -> None:
        """Clears every gradient chunk (optimizer.zero_grad() and model.zero_grad() call it)."""
        self.check_open("zero_grad")
        self.runtime.zero_grad()
        self.clipper.reset()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach=None) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over every gradient of the model: returns the total norm
        (before clipping) and clips exactly as torch does, folded into the next step's gradient
        factor (see _clipping.py). Call it after the last backward, before optimizer.step().
        `foreach` is accepted for torch's signature and changes nothing."""
        self.check_open("clip_grad_norm_")
        return self.clipper.clip(max_norm, norm_type, error_if_nonfinite)

    def gathered(self, params=None, writable: bool = False):
        """`with engine.gathered(params=None, writable=False):` the listed parameters (default all)
        whole and current on the compute device, their chunks held there until the block ends;
        with writable=True, in-place edits made inside reach the fp32 masters on exit. Collective
        when sharded: every rank enters with the same list (see _param_access.py)."""
        self.check_open("gathered")
        return self.access.gathered(params, writable)

    def grad(self, param) -> torch.Tensor | None:
        """The accumulated gradient of `param` (fp32, CPU) as it is in its chunk, or None."""
        self.check_open("grad")
        idx = self.parameter_index(param)
        if not param.requires_grad or not self.runtime.has_grad(idx):
            return None
        return self.runtime.read_grad(idx)

    def synchronize(self) -> None:
        """Waits for every CPU optimizer step still running (overlap_optimizer) and for the device.
        Afterwards a parameter read outside the hooks holds the last step's values wherever its
        chunk is on the device (the next forward, state_dict() and checkpoints do this themselves)."""
        self.check_open("synchronize")
        self.runtime.synchronize()

    # --- for gemini_ext's own modules -------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def attached_optimizer(self):
        """The engine's optimizer, or None before engine.optimizer()."""
        return self._optimizer

    def attach_optimizer(self, opt) -> None:
        if self._optimizer is not None:
            raise RuntimeError("engine.optimizer(): this engine already has an optimizer; the optimizer state lives "
                               "in the engine's chunks, so there can be only one. Reuse the first one.")
        self._optimizer = opt

    def detach_optimizer(self, opt) -> None:
        """The optimizer's construction failed after attach_optimizer: the engine has none."""
        if self._optimizer is opt:
            self._optimizer = None

    def check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"engine.{what}(): the engine is closed (its `with` block has ended); call "
                               "gx.enable(model, config) again.")

    def check_no_stray_grads(self) -> None:
        for name, p in zip(self.layout.names, self.layout.params):
            if p.grad is not None:
                raise RuntimeError(f"gemini_ext: parameter {name!r} has a .grad that did not go into its chunk (was "
                                   "requires_grad changed after gx.enable, or .grad assigned by hand?). Set "
                                   "requires_grad before gx.enable; gradients must come from backward.")

    def end_iteration(self) -> None:
        """The iteration boundary (the optimizer's step calls it once forward and backward are
        done): closes the access trace, records the iteration's figures and lets the policy act
        on what it measured."""
        self.runtime.end_iteration()
        self.tracer.end_iteration(self._hooks.last_pass_seconds())
        self.placer.after_iteration(self.runtime, self.tracer)

    def _on_forward_start(self) -> None:
        self.access.absorb_writes()

    def _on_backward_start(self) -> None:
        if self._optimizer is not None:
            self._optimizer.backward_started()

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The full model state: fp32 tensors on the CPU under the model's own keys (trainable
        parameters from their fp32 masters)."""
        self.check_open("state_dict")
        return self.access.full_state_dict()

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Loads a full (plain) state dict into the chunks: masters, their 16-bit copies, buffers."""
        self.check_open("load_state_dict")
        return self.access.load_full_state_dict(state_dict, strict)

    def save_checkpoint(self, path: str) -> None:
        """Model masters, optimizer, loss scaler, step counts and RNG states (see checkpoint.py)."""
        self.check_open("save_checkpoint")
        self.access.absorb_writes()
        checkpoint.save(self, path)

    def load_checkpoint(self, path: str) -> None:
        self.check_open("load_checkpoint")
        self.access.absorb_writes()
        checkpoint.load(self, path)
        self.runtime.note_param_versions()

    # --- observing ---------------------------------------------------------------------------
    def chunk_info(self, chunk_id: int) -> dict:
        return self.chunks.chunk_info(chunk_id)

    def memory_timeline(self) -> dict:
        """Scheduling events (fetch 'F', prefetch 'P', evict 'E', iteration end 'S') with the chunk
        bytes on the device after each, and the per-iteration figures of stats()["steps"]."""
        self.check_open("memory_timeline")
        return self.tracer.timeline()

    def stats(self) -> dict:
        """Chunk layout, bytes per tier, traffic and counters so far; after close(), as of the close."""
        if self._closed:
            return self._stats_at_close
        out = {
            "device": self.device_kind,
            "precision": self.config.precision,
            "num_param_chunks": len(self.layout.sets),
            "chunk_size": self.chunk_size,
            "wasted_bytes": self.layout.param_wasted_bytes,  # padding of the parameter chunks
            **self.tracer.stats(),
            "optimizer_steps": self.counters.optimizer_steps,
            "skipped_steps": self.counters.skipped_steps,
            "loss_scale": self.scaler.scale if self.scaler is not None else None,
            "setup_seconds": {"total": self.setup_seconds, **self.setup_phases},
            "setup_fill_seconds": dict(self.setup_fill_parts),  # the fill phase in parts
            "distributed": self.groups.summary(),
            "placement": self.placer.summary(self.runtime),
        }
        if self._optimizer is not None:
            out["last_step"] = self._optimizer.last_step_stats()
        return out

    # --- closing -----------------------------------------------------------------------------
    def close(self) -> None:
        """Restores ordinary parameters holding the current values and frees the chunks (idempotent)."""
        if self._closed:
            return
        self.access.absorb_writes()  # in-place writes since the last step reach the masters first
        self.runtime.stop_reclaiming()  # memory pressure no longer reaches this engine's chunks
        self.runtime.synchronize()
        self._stats_at_close = self.stats()
        self._restorer = _restore.ModelRestorer(self.runtime, self.chunks, self.layout, self.groups, self.device)
        spares = self._optimizer.release_spares if self._optimizer is not None else (lambda: None)
        restored, staged = self._restorer.restore(spares)
        self._release_engine()
        self._close_staged_params = self._restorer.staged_params  # for tests and logs
        if restored and staged:
            self._move_staged_params(staged)
        self._close_params_left_on_host = self._restorer.params_left_on_host

    def _move_staged_params(self, staged: list[int]) -> None:
        self._restorer.move_staged_params(staged)

    def _release_engine(self) -> None:
        """The end of close(): buffers back to their dtype and device, hooks off, and the chunks
        freed with the engine's last references to the manager."""
        self._buffers.restore()
        self._hooks.remove()
        self.access.remove()
        self._hooks.gm = None  # the manager (and every chunk) goes with the engine's references below
        self._closed = True
        _guards.engine_closed(self)
        _registry.unregister(self.model, self)
        self.tracer.detach()
        if getattr(self, "_restorer", None) is not None:
            self._restorer.detach()
        del self.runtime  # unbinds the parameter storages; then the pools go
        del self.chunks

    def __enter__(self) -> "GeminiEngine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, torch.OutOfMemoryError) and self.device.is_cuda and allocator.mode() == "default":
            exc.add_note(f"gemini_ext: torch's allocator ran out of device memory with "
                         f"{format_bytes(self.chunks.tier_bytes('device')['current'])} of chunks on the device "
                         f"(placement_policy={self.config.placement_policy!r}). Under GEMINI_EXT_ALLOCATOR=default "
                         "chunks are not evicted for torch's allocations: set GEMINI_EXT_ALLOCATOR=chunk (before "
                         "importing gemini_ext) so that chunks go to the host on demand, or lower gpu_memory_limit / "
                         "const_gpu_budget, the batch size, or use activation checkpointing.")
        if isinstance(exc, (torch.OutOfMemoryError, _C.OutOfMemoryError)):
            exc.add_note(f"gemini_ext: memory when it ran out: {self.tracer.memory_figures()}.")
        self.close()


def enable(model: torch.nn.Module, config: GeminiConfig | None = None, *, process_group=None, param_init_fn=None,
           **overrides) -> GeminiEngine:
    """Places `model`'s parameters in chunks; use as `with gx.enable(model, cfg) as engine:`.

    A model built under `torch.device("meta")` gets storage on the compute device one module
    group at a time as its values go into chunks (see gemini_ext/_materialize.py):
    `param_init_fn(module)` initialises each module that owns meta tensors (default: the module's
    reset_parameters())."""
    if config is not None and not isinstance(config, GeminiConfig):
        raise TypeError(f"enable(config=...): expected a GeminiConfig, got {type(config).__name__}.")
    config = config or GeminiConfig()
    if overrides:
        config = config.replace(**overrides)
    return GeminiEngine(model, config, process_group, param_init_fn)
