"""enable() and GeminiEngine: parameters moved into chunk storage for the life of a `with` block.

[Note: what this stage of the engine does]
Every parameter is registered into a chunk group of its dtype in definition order (tied
parameters once), its values are written into the chunk's host copy, every chunk is moved to
the device tier (one H2D copy per chunk, counted as chunk traffic) and the parameter, still the
same Python object, is rebound to a view of its slot in the device copy. Training then updates
the chunks in place. Leaving the block moves every chunk back to the host and rebinds each
parameter to an ordinary tensor on its original device, holding the trained values.
All chunks stay resident on the device between enable() and close(): the scheduler (prefetch,
eviction, placement policies), mixed-precision chunks with fp32 masters and the chunked
optimizer are later stages; config fields that only they honour are accepted, validated and
listed in one warning, so that nothing is silently ignored.
"""

from __future__ import annotations

import time
import warnings

import torch

from . import _C
from ._env import SETTINGS, logger
from ._units import format_bytes
from .config import DEFAULT_SIM_CAPACITY_BYTES, GeminiConfig
from .search import search_chunk_configuration, unique_parameters

SUPPORTED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)

# Fields this stage honours; any other field with a non-default value is reported.
# shard_param_frac has no effect with one rank, the only world size of this stage.
_HONOURED = {"shard_param_frac", "chunk_config_dict", "chunk_init_device", "search_range_m", "min_chunk_size_m", "gpu_memory_limit",
             "pin_memory", "device", "sim_capacity"}


def cuda_available() -> bool:
    """A CUDA build of the extension on a machine where torch sees a GPU."""
    return bool(_C.build_info()["cuda"]) and torch.cuda.is_available()


def resolve_device(config: GeminiConfig) -> str:
    device = config.device if config.device != "auto" else SETTINGS.device
    if device == "auto":
        return "cuda" if cuda_available() else "sim"
    if device == "cuda" and not cuda_available():
        info = _C.build_info()
        why = "this gemini_ext build has no CUDA support" if not info["cuda"] else "torch sees no CUDA device"
        raise RuntimeError(f"device='cuda' requested, but {why}. Use device='sim' (or GEMINI_EXT_DEVICE=sim) on "
                           "machines without a GPU, or rebuild against a CUDA torch.")
    return device


def _unhonoured_fields(config: GeminiConfig) -> list[str]:
    """Settings that ask for behaviour this stage does not have (see the Note at the top)."""
    default = GeminiConfig()
    asked = {f for f in config.__dataclass_fields__
             if f not in _HONOURED | {"precision", "offload_optim_frac"} and getattr(config, f) != getattr(default, f)}
    if config.precision != "fp32":
        asked.add("precision")  # chunks keep the parameters' own dtype
    if config.offload_optim_frac > 0:
        asked.add("offload_optim_frac")  # optimizer state stays with the torch optimizer
    return [f"{f}={getattr(config, f)!r}" for f in sorted(asked)]


class GeminiEngine:
    """Owns the chunks of one model; see enable()."""

    def __init__(self, model: torch.nn.Module, config: GeminiConfig, process_group=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"enable(model): expected a torch.nn.Module, got {type(model).__name__}.")
        if getattr(model, "_gemini_engine", None) is not None:
            raise RuntimeError(f"enable(): this {type(model).__name__} is already managed by an open engine; "
                               "close it (leave its `with` block) first.")
        world_size = 1
        if process_group is not None or (torch.distributed.is_available() and torch.distributed.is_initialized()):
            world_size = torch.distributed.get_world_size(process_group)
        if world_size != 1:
            raise NotImplementedError(f"enable(): world size {world_size}: sharding chunks across ranks is not "
                                      "implemented in this release; run one process, or wait for the ZeRO-3 stage.")
        if SETTINGS.allocator == "chunk":
            raise NotImplementedError("GEMINI_EXT_ALLOCATOR=chunk: the process-wide chunk allocator is not in this "
                                      "release; unset GEMINI_EXT_ALLOCATOR or set it to 'default'.")
        ignored = _unhonoured_fields(config)
        if ignored:
            warnings.warn("gemini_ext: this release keeps every chunk resident on the device in the parameters' own "
                          "dtype and uses the torch optimizer on those chunks; these settings are validated but not "
                          "acted on yet: " + ", ".join(ignored), stacklevel=3)
        self.model = model
        self.config = config
        self.device_kind = resolve_device(config)
        self._closed = False
        start = time.perf_counter()

        named = unique_parameters(model)
        if not named:
            raise ValueError(f"enable(): {type(model).__name__} has no parameters to place in chunks.")
        chunk_cfg = config.chunk_config_for(world_size)
        if chunk_cfg is None:
            found = search_chunk_configuration(model, config.search_range_m, config.min_chunk_size_m)
            chunk_size = found["chunk_size"]
        else:
            chunk_size = chunk_cfg["chunk_size"]
        self.chunk_size = chunk_size

        if self.device_kind == "cuda":
            limit = config.gpu_memory_limit or SETTINGS.gpu_limit_bytes or 0
            index = torch.cuda.current_device()
            self._ctx = _C.DeviceContext("cuda", device_index=index, capacity_bytes=limit)
            self.compute_device = torch.device("cuda", index)
        else:
            capacity = config.sim_capacity or SETTINGS.gpu_limit_bytes or DEFAULT_SIM_CAPACITY_BYTES
            self._ctx = _C.DeviceContext("sim", capacity_bytes=capacity)
            self.compute_device = torch.device("cpu")
        self._mgr = _C.ChunkManager(self._ctx, pin_memory=config.pin_memory)
        host = self._mgr.host_tier

        groups = {}
        for name, p in named:
            group = f"param.{str(p.dtype).replace('torch.', '')}"
            if group not in groups:
                self._mgr.create_group(group, p.dtype, chunk_size, host)
                groups[group] = p.dtype
        self._params = []  # (name, parameter, handle, original device)
        for name, p in named:
            group = f"param.{str(p.dtype).replace('torch.', '')}"
            handle = self._mgr.register_tensor(group, name, p.numel(), list(p.shape))
            self._params.append((name, p, handle, p.device))
        self._mgr.finalize()
        with torch.no_grad():
            for name, p, handle, _ in self._params:
                self._mgr.tensor_view(handle, host).copy_(p.detach())
                self._mgr.transition(handle, _C.TensorState.HOLD)
        for chunk_id in range(self._mgr.num_chunks):
            self._mgr.move(chunk_id, "device")
        for name, p, handle, _ in self._params:
            p.data = self._mgr.tensor_view(handle, "device")
            if p.grad is not None:  # an existing gradient follows its parameter
                p.grad = p.grad.to(self.compute_device)
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None and buf.device != self.compute_device:
                    module._buffers[key] = buf.to(self.compute_device)
        model._gemini_engine = self
        self.setup_seconds = time.perf_counter() - start
        logger.info("enable: %d parameters in %d chunks of %d elements on %s (%s wasted), %.2f s",
                    len(self._params), self._mgr.num_chunks, chunk_size, self.device_kind,
                    format_bytes(self._mgr.wasted_bytes()), self.setup_seconds)

    # --- public API -------------------------------------------------------------------------
    def optimizer(self, cls, **kwargs) -> torch.optim.Optimizer:
        """A `cls` optimizer over the chunk-backed parameters (Adam or AdamW)."""
        self._check_open("optimizer")
        if not (isinstance(cls, type) and issubclass(cls, SUPPORTED_OPTIMIZERS)):
            name = getattr(cls, "__name__", repr(cls))
            raise TypeError(f"engine.optimizer: {name} is not supported; supported: torch.optim.Adam, "
                            "torch.optim.AdamW.")
        if kwargs.get("amsgrad", False):
            raise ValueError("engine.optimizer: amsgrad=True is not supported; pass amsgrad=False.")
        params = [p for _, p, _, _ in self._params if p.requires_grad]
        return cls(params, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self._check_open("backward")
        loss.backward()

    def stats(self) -> dict:
        """Chunk layout, bytes per tier and chunk traffic so far; after close(), as of the close
        (the moves back to the host included)."""
        if self._closed:
            return self._stats_at_close
        tiers = {t: self._mgr.tier_bytes(t) for t in ("device", "pinned_host", "pageable_host")}
        return {
            "device": self.device_kind,
            "num_chunks": self._mgr.num_chunks,
            "chunk_size": self.chunk_size,
            "wasted_bytes": self._mgr.wasted_bytes(),
            "tier_bytes": tiers,
            "traffic": self._mgr.traffic(),
            "placement": {"policy": "resident", "device_chunks": self._mgr.num_chunks, "host_chunks": 0},
        }

    def state_dict(self) -> dict:
        """The full model state: fp32 tensors on the CPU under the model's own keys."""
        self._check_open("state_dict")
        return {k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu().clone()
                for k, v in self.model.state_dict().items()}

    def chunk_info(self, chunk_id: int) -> dict:
        return self._mgr.chunk_info(chunk_id)

    def parameter_handle(self, param: torch.nn.Parameter):
        for _, p, handle, _ in self._params:
            if p is param:
                return handle
        raise ValueError("parameter_handle: the tensor is not a parameter managed by this engine.")

    def close(self) -> None:
        """Moves every chunk back to the host and restores ordinary parameters (idempotent)."""
        if self._closed:
            return
        self._ctx.synchronize()
        host = self._mgr.host_tier
        for chunk_id in range(self._mgr.num_chunks):
            self._mgr.move(chunk_id, host)
        with torch.no_grad():
            for _, p, handle, device in self._params:
                p.data = self._mgr.tensor_view(handle, host).to(device, copy=True)
                if p.grad is not None:
                    p.grad = p.grad.to(device)
        self._stats_at_close = self.stats()
        self._closed = True
        self.model._gemini_engine = None
        del self._mgr  # frees the chunk pools; the views into them were replaced above
        del self._ctx

    def __enter__(self) -> "GeminiEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"engine.{what}(): the engine is closed (its `with` block has ended); call "
                               "gx.enable(model, config) again.")


def enable(model: torch.nn.Module, config: GeminiConfig | None = None, *, process_group=None,
           **overrides) -> GeminiEngine:
    """Places `model`'s parameters in chunks; use as `with gx.enable(model, cfg) as engine:`."""
    config = (config or GeminiConfig()).replace(**overrides) if overrides else (config or GeminiConfig())
    if not isinstance(config, GeminiConfig):
        raise TypeError(f"enable(config=...): expected a GeminiConfig, got {type(config).__name__}.")
    return GeminiEngine(model, config, process_group)
