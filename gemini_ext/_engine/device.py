"""The compute device of an engine: which backend (`cuda` or `sim`), its DeviceContext, and the
device bytes the engine plans for."""

from __future__ import annotations

import torch

from .._native import _C
from .._env import SETTINGS
from ..config import DEFAULT_SIM_CAPACITY_BYTES, GeminiConfig


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


class ComputeDevice:
    """The backend an engine's chunks live on, and the torch device its compute runs on (the GPU;
    the CPU for `sim`, a simulated device made of host memory)."""

    def __init__(self, config: GeminiConfig):
        self.kind = resolve_device(config)
        if self.kind == "cuda":
            limit = config.gpu_memory_limit or SETTINGS.gpu_limit_bytes or 0
            index = torch.cuda.current_device()
            self.context = _C.DeviceContext("cuda", device_index=index, capacity_bytes=limit)
            self.torch_device = torch.device("cuda", index)
        else:
            # gpu_memory_limit is the budget the engine plans for on sim as on cuda: within a sim
            # device of sim_capacity bytes (the config refuses a limit above it).
            capacity = (config.gpu_memory_limit or config.sim_capacity or SETTINGS.gpu_limit_bytes
                        or DEFAULT_SIM_CAPACITY_BYTES)
            self.context = _C.DeviceContext("sim", capacity_bytes=capacity,
                                            sim_max_copy_delay_us=SETTINGS.sim_copy_delay_us, sim_seed=1)
            self.torch_device = torch.device("cpu")

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def capacity_bytes(self) -> int:
        """The device bytes the engine plans for: `gpu_memory_limit` (or GEMINI_EXT_GPU_LIMIT), never
        more than the device has; the sim device's capacity on sim."""
        capacity = self.context.capacity_bytes
        if self.is_cuda:
            total = torch.cuda.mem_get_info(self.torch_device)[1]
            capacity = min(capacity, total) if capacity else total
        return int(capacity)

    def total_bytes(self) -> int:
        """The whole device (cuda), whatever gpu_memory_limit says; the sim device's capacity."""
        if self.is_cuda:
            return int(torch.cuda.mem_get_info(self.torch_device)[1])
        return int(self.context.capacity_bytes)

    def free_bytes(self) -> int | None:
        """The device's free memory (cuda); None on sim."""
        return torch.cuda.mem_get_info(self.torch_device)[0] if self.is_cuda else None

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)
