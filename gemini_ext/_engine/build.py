"""build_parts: what enable() builds, in order, as an EngineParts
(see [Note: what enable() builds], engine.py).

Each part receives the parts it uses, never the engine: the facade (engine.py) only holds the
result. A failure after the first chunk was filled rolls the fill back (_engine/fill.py), so the
model's parameters are as they were.
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch

from .._native import _C
from .._env import logger
from .._units import format_bytes
from .. import allocator
from ..amp import DynamicLossScaler
from ..placement.chunk_floor import chunk_floor_bytes
from ..placement.costs import HOST_TIERS
from ..placement.placer import Placer
from ..placement.policies import make_policy
from ..placement.tracer import MemoryTracer, SetupTimer
from ..search import unique_parameters
from . import restore
from .activations import ActivationManager, require_blocks
from .buffers import BufferPlacement
from .clipping import GradClipper
from .device import ComputeDevice
from .fill import ChunkFill, allocated_on_write
from .hooks import HookSet
from .loss_scale_boundary import LossScaleBoundary
from .layout import COMPUTE_DTYPES, STATE_DTYPES, ChunkLayout, check_parameters, choose_chunk_size
from .materialize import MetaMaterializer
from .param_access import ParamAccess
from .generation import GenerationBudget
from .phases import StatePhases
from .parts import EngineParts
from .process_groups import DataParallelGroups, resolve_process_group
from .sharded_state import ShardedState
from .throughput import Throughput


def build_parts(model: torch.nn.Module, config, process_group, param_init_fn, max_state_kinds: int) -> EngineParts:
    """The chunk layout, the placement, the filled chunks, the manager and everything over it.
    `max_state_kinds`: the most optimizer state chunks a set may need (the optimizer rules' most,
    which the optimizer room above knows)."""
    data_parallel = resolve_process_group(process_group)
    if (unsupported := config.unsupported_without_masters()) is not None:
        raise NotImplementedError(unsupported)
    if config.activation_checkpointing != "off" or config.activation_offload == "auto":
        require_blocks(model, f"activation_checkpointing={config.activation_checkpointing!r}"
                       if config.activation_checkpointing != "off" else "activation_offload='auto'")  # before anything
    parts = EngineParts(config, COMPUTE_DTYPES[config.precision])
    # ZeRO inside a group, replicas across groups (HSDP): chunks are sharded over the ZeRO group.
    parts.groups = DataParallelGroups(data_parallel, config.extra_dp_size)
    parts.scaler = DynamicLossScaler.from_config(config) if config.precision == "fp16" else None
    if parts.scaler is not None:
        parts.loss_scale = LossScaleBoundary(lambda: parts.scaler.scale)
    parts.clipper = GradClipper(parts)
    timer = SetupTimer()
    policy = make_policy(config)
    parts.device = ComputeDevice(config)
    if parts.device.is_cuda:
        parts.groups.set_device(parts.device.torch_device)
    parts.groups.ranks_on_host()  # collective: gathered here, on every rank, and kept for the host budget
    named = unique_parameters(model)
    check_parameters(model, named, config, parts.compute_dtype)
    parts.chunk_size = choose_chunk_size(model, named, config, parts.groups.world_size)
    parts.chunks = _open_chunk_manager(parts)
    meta = MetaMaterializer(model, parts.device.torch_device, param_init_fn)  # empty unless built on meta
    parts.layout = ChunkLayout(parts.chunks, named, parts.compute_dtype, parts.device.torch_device, max_state_kinds,
                               parts.chunk_size, STATE_DTYPES[config.optimizer_state_dtype], config.master_weights)
    parts.placer = Placer(policy, parts.layout, parts.device, parts.groups)
    parts.placer.initial()
    device_first, device_grads = parts.placer.device_first_chunks()
    on_write = allocated_on_write(parts.layout, device_first, parts.device.torch_device)
    timer.done("plan")  # chunk size, layouts, placement plan
    parts.chunks.finalize([c for c in device_first if c not in on_write],
                          device_grads + parts.layout.unbound_state_chunks() + sorted(on_write))
    timer.done("allocate")  # every chunk's first copy, zeroed
    fill = ChunkFill(parts.layout, parts.chunks, parts.groups, parts.device, meta)
    try:
        fill.run(set(device_first), on_write)
        parts.setup_fill_parts = fill.parts
        timer.done("fill")  # the parameters' values into chunks (materialising a meta-built model)
        _start_runtime(parts, model)
        timer.done("place")  # the placement applied, parameter views, buffers, hooks
    except BaseException as exc:
        fill.rollback(exc)
        raise
    fill.commit()
    parts.setup_phases = timer.phases
    parts.setup_seconds = timer.total()
    _warn_if_close_cannot_restore(parts)
    logger.info("enable: %d parameters in %d chunks of %d elements on %s (%s wasted), %.2f s (%s)",
                len(parts.layout.params), parts.chunks.num_chunks, parts.chunk_size, parts.device.kind,
                format_bytes(parts.chunks.wasted_bytes()), parts.setup_seconds,
                ", ".join(f"{k} {v:.2f} s" for k, v in parts.setup_phases.items()))
    if logger.isEnabledFor(logging.INFO):  # /proc and the device are read only when it prints
        logger.info("enable: memory after set-up: %s", parts.tracer.memory_figures())
    return parts


def _open_chunk_manager(parts: EngineParts):
    chunks = _C.ChunkManager(parts.device.context, world_size=parts.groups.world_size, rank=parts.groups.rank,
                             pin_memory=parts.config.pin_memory)
    zero, replica = parts.groups.zero, parts.groups.replica
    if zero is not None:
        if parts.device.is_cuda and torch.distributed.get_backend(zero) != "nccl":
            warnings.warn("gemini_ext: chunks on cuda with a non-NCCL process group; collectives on device "
                          "memory need a backend that supports CUDA tensors (nccl).", stacklevel=5)
        parts.zero_comm = _C.ProcessGroupCommunicator(zero, parts.device.context)
        chunks.set_communicator(parts.zero_comm)
        if replica is not None:
            parts.replica_comm = _C.ProcessGroupCommunicator(replica, parts.device.context)
    return chunks


def _start_runtime(parts: EngineParts, model: torch.nn.Module) -> None:
    """The C++ runtime over the filled chunks, the placement applied, parameter views, buffers,
    hooks."""
    config, layout = parts.config, parts.layout
    pspecs = [(chunk, slot, bool(p.requires_grad)) for (chunk, slot), p in zip(layout.slots, layout.params)]
    parts.runtime = runtime = _C.GeminiManager(parts.chunks, parts.placer.set_specs(), pspecs,
                                               config.placement_policy)
    if parts.replica_comm is not None:
        runtime.set_replica_communicator(parts.replica_comm)
    runtime.set_device_budget(parts.placer.current.device_budget_bytes)
    parts.tracer = MemoryTracer(parts.chunks, runtime, parts.device)
    parts.tracer.begin()  # per-iteration non-model peaks start here
    runtime.set_async_reduce(config.enable_async_reduce)
    runtime.set_max_prefetch(config.max_prefetch)
    runtime.set_overlap_optimizer(config.overlap_optimizer)
    if config.enable_gradient_accumulation:
        runtime.set_no_sync(True)  # gradients accumulate on the device until the step
    views = runtime.param_views()
    runtime.apply_placement()
    for tier in HOST_TIERS:  # groups that left the host give their arena back
        parts.chunks.trim(tier)
    _bind_parameters(parts, views)
    parts.buffers = BufferPlacement(model, parts.device.torch_device, parts.compute_dtype, config.cast_buffers,
                                    parts.groups.from_rank0)

    def on_backward_start():
        if parts.optimizer is not None:
            parts.optimizer.backward_started()
        if parts.activations is not None:
            parts.activations.backward_started()

    # see [Note: which hook does what] (hooks.py)
    parts.hooks = HookSet(runtime, model, layout.params,
                          loss_scale=parts.loss_scale,
                          on_backward_start=on_backward_start,
                          on_forward_start=lambda: _forward_starts(parts))
    parts.access = ParamAccess(parts, model)
    parts.sharded_state = ShardedState(parts, model)
    # see [Note: what MFU counts] (throughput.py)
    parts.throughput = Throughput(model, layout.params, config, parts.device.torch_device)
    parts.phases = StatePhases(runtime, parts.chunks, parts.layout, parts.device, parts.groups.ranks_on_host())
    _plan_activations(parts, model)
    parts.generation = GenerationBudget(runtime, layout, parts.phases, parts.activations, parts.hooks,
                                        parts.groups.ranks_on_host())


def _forward_starts(parts: EngineParts) -> None:
    """Before the model's forward fetches anything: refused while the states are offloaded, and
    parameters written outside the hooks reach their chunks."""
    parts.phases.check_resident("the model's forward")
    parts.generation.forward_starts()
    parts.access.absorb_writes()


def _plan_activations(parts: EngineParts, model: torch.nn.Module) -> None:
    """The activation manager, where the config asks for checkpointing or offload."""
    config = parts.config
    if config.activation_checkpointing == "off" and config.activation_offload == "off":
        return
    planned = "auto" in (config.activation_checkpointing, config.activation_offload)
    parts.activations = ActivationManager(model, config, parts.device, (parts.chunks, parts.placer, parts.tracer),
                                       parts.groups.ranks_on_host(),
                                       cap_torch=planned and allocator.mode() == "default",
                                       lower_budget=functools.partial(parts.placer.lower_budget_in_warm_up,
                                                                      parts.runtime),
                                       chunk_floor_bytes=chunk_floor_bytes(parts.layout.shard_bytes))


def _bind_parameters(parts: EngineParts, views) -> None:
    """Each parameter's .data becomes its chunk view; an existing gradient follows it into its
    gradient chunk."""
    existing = []
    for i, (p, view) in enumerate(zip(parts.layout.params, views)):
        if p.grad is not None:
            if not p.requires_grad:
                warnings.warn(f"gemini_ext: frozen parameter {parts.layout.names[i]!r} has a .grad; frozen "
                              "parameters have no gradient chunk, so it is dropped.", stacklevel=6)
            else:
                existing.append((i, p.grad.detach()))
        p.data = view
        p.grad = None  # gradients live in chunks from now on
    if existing:
        with torch.no_grad():
            for i, g in existing:
                p = parts.layout.params[i]
                p.grad = g.to(device=p.device, dtype=p.dtype)
                parts.runtime.post_accumulate_grad(i, p)
        parts.runtime.end_backward()


def _warn_if_close_cannot_restore(parts: EngineParts) -> None:
    whole = parts.layout.whole_model_bytes()
    free_bytes = restore.restore_free_bytes(parts.chunks, parts.device, parts.groups.ranks_on_host())
    if free_bytes is not None and whole > free_bytes:
        warnings.warn(
            f"gemini_ext: the whole model ({format_bytes(whole)} in its original dtypes) is larger than this "
            f"rank's device and host memory ({format_bytes(free_bytes)}), so leaving the `with` block cannot give it "
            "back as ordinary tensors: close() will leave the parameters empty. Keep the trained values with "
            "engine.save_checkpoint(dir) (sharded; loads at any world size) or engine.state_dict() inside the "
            "block.", stacklevel=5)
