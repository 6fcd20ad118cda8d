"""EngineInternals: what gemini_ext's own modules use of an engine.

The optimizer wrapper, the generic rule, checkpoints, clipping and parameter access are handed
`engine.internal`, typed by this Protocol, instead of reading a dozen public attributes off the
facade: the facade (gemini_ext/engine.py) keeps the user's API, and what the other modules share is
named here once. EngineParts (parts.py) is the one implementation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # types only: the modules below import nothing from here at run time
    import torch

    from ..amp import DynamicLossScaler
    from ..config import GeminiConfig
    from ..placement.placer import Placer
    from ..placement.tracer import MemoryTracer
    from .clipping import GradClipper
    from .device import ComputeDevice
    from .layout import ChunkLayout
    from .param_access import ParamAccess
    from .sharded_state import ShardedState
    from .throughput import Throughput
    from .parts import TrainingCounters
    from .process_groups import DataParallelGroups


class EngineInternals(Protocol):
    config: "GeminiConfig"
    compute_dtype: "torch.dtype"
    groups: "DataParallelGroups"        # the ZeRO and replica process groups
    device: "ComputeDevice"
    layout: "ChunkLayout"               # each parameter's chunk and slot, the chunk groups
    chunks: Any                         # _C.ChunkManager: the chunks, their copies and traffic
    runtime: Any                        # _C.GeminiManager: hooks, gradients, values, the optimizer step
    placer: "Placer"
    tracer: "MemoryTracer"
    throughput: "Throughput"            # tokens and time per iteration, MFU
    access: "ParamAccess"
    sharded_state: "ShardedState"       # this rank's share of the state as DTensors (DCP)
    clipper: "GradClipper"
    scaler: "DynamicLossScaler | None"  # fp16 only
    loss_scale: Any                     # fp16 only: loss_scale_boundary.LossScaleBoundary
    counters: "TrainingCounters"
    chunk_size: int                     # elements per chunk
    buffers: Any                        # buffers.BufferPlacement: the model's buffers on the compute device
    zero_comm: Any                      # _C.ProcessGroupCommunicator over groups.zero, or None
    replica_comm: Any                   # over groups.replica (HSDP), or None
    optimizer: Any                      # the attached GeminiOptimizer, or None
    activations: Any                    # activations.ActivationManager, or None (checkpointing and offload off)
    closed: bool

    def check_open(self, what: str) -> None:
        """RuntimeError naming `engine.<what>()` once the engine is closed."""

    def attach_optimizer(self, opt) -> None:
        """Records the engine's one optimizer; RuntimeError when it has one already."""

    def detach_optimizer(self, opt) -> None:
        """The optimizer's construction failed after attach_optimizer: the engine has none."""

    def check_no_stray_grads(self) -> None:
        """RuntimeError naming a parameter whose .grad did not go into its chunk."""

    def zero_grad(self) -> None:
        """Clears every gradient chunk (refused after a backward that stepped sets in place)."""

    def end_iteration(self) -> dict:
        """The iteration boundary: closes the access trace, records the iteration's figures and
        lets the policy act; returns the manager's report (counters, trace re-recordings)."""
