"""GeminiConfig: every knob of the engine (the README's table), validated when built."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any

from ._env import DEVICES
from ._units import parse_bytes
from .placement.policies import POLICY_CLASSES

PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZER_STATE_DTYPES = ("fp32", "bf16")
PLACEMENT_POLICIES = tuple(POLICY_CLASSES)
ACTIVATION_OFFLOAD_MODES = ("off", "on", "auto")
ACTIVATION_CHECKPOINTING_MODES = ("off", "on", "auto")
HOST_STEP_SPECULATION_MODES = ("in_place", "spares", "off")
HOST_STEPS_MODES = ("serial", "at_step", "spares", "in_place", "in_backward")
HOST_STEPS_FIELDS = ("host_steps", "overlap_optimizer", "host_step_speculation", "optimizer_step_in_backward")
DEFAULT_SIM_CAPACITY_BYTES = 4 * 2**30  # the sim device's size when sim_capacity is None


@dataclasses.dataclass(frozen=True)
class GeminiConfig:
    precision: str = "bf16"
    placement_policy: str = "static"
    chunk_config_dict: dict | None = None
    chunk_init_device: str | None = None  # None: the engine's device
    search_range_m: float = 128
    min_chunk_size_m: float = 32
    shard_param_frac: float = 1.0
    offload_optim_frac: float = 1.0
    offload_param_frac: float = 0.0
    const_gpu_budget: int | str | None = None
    gpu_memory_limit: int | str | None = None
    max_prefetch: int = 2
    enable_gradient_accumulation: bool = False
    initial_scale: float = 2.0**16
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    max_scale: float = 2.0**32
    max_norm: float = 0.0
    enable_async_reduce: bool = True
    extra_dp_size: int = 1
    pin_memory: bool = True
    master_weights: bool = True
    device: str = "auto"
    sim_capacity: int | str | None = None
    # Floating buffers keep their dtype inside the block, as under autocast (rotary frequencies,
    # normalisation statistics stay fp32); True casts them to the compute precision. Either way
    # close() gives every buffer back exactly as the model left it.
    cast_buffers: bool = False
    # Extension (not in the original): the CPU optimizer step of host chunks runs on a background
    # thread, in forward order, while the caller goes on; the next forward waits per chunk. The
    # result is the serial step's, bit for bit. False: step() returns only once every chunk is
    # stepped (the serial step, for comparison).
    overlap_optimizer: bool = True
    # Extension: with overlap_optimizer, the host sets' steps start during backward where they can
    # be guessed (docs/USAGE.md, "The host's steps during backward"). "in_place": stepped in place
    # and corrected or undone at step() where the rule can (Adam/AdamW with fp32 state), spare
    # copies for the others; "spares": spare copies for every rule; "off": every host set steps at
    # step() (for comparison).
    host_step_speculation: str = "in_place"
    # Extension (not in the original): each host-held chunk set's optimizer step starts during
    # backward, in place, as soon as its gradients reach the host, with the hyperparameters of the
    # backward's start; optimizer.step() steps the rest. Exact (the same bits as step()) for what it
    # accepts: no clipping that scales and no fp16 loss scaling, one backward per optimizer step
    # (accumulate under engine.no_sync() or enable_gradient_accumulation), hyperparameters changed
    # only after step(). What it refuses raises (docs/USAGE.md).
    optimizer_step_in_backward: bool = False
    # Extension: when the host-held chunk sets' optimizer steps start, one knob for the three above,
    # which stay as its aliases (docs/USAGE.md, "When the host steps"): "serial" (at step(), settled
    # before it returns: overlap_optimizer=False), "at_step" (at step(), finishing during the next
    # forward: host_step_speculation="off"), "spares", "in_place" (during backward where the guess
    # can hold: host_step_speculation=...), "in_backward" (optimizer_step_in_backward=True). None:
    # read from the aliases, "in_place" by default. After construction every one of the four says
    # the same; an alias set to something else than host_steps is refused.
    host_steps: str | None = None
    # Extension (not in the original), changes the numerics: "bf16" keeps Adam's moments (m, v) in
    # bf16 with stochastic rounding, 12 instead of 16 bytes per trainable parameter under bf16
    # (the fp32 master stays). Adam / AdamW only. With master_weights=False and precision="bf16"
    # too, the bf16 parameter is the master, its update rounded stochastically: 8 bytes per
    # parameter (parameter, gradient, m, v) against 16.
    optimizer_state_dtype: str = "fp32"
    # For stats()["throughput"] (see _engine/throughput.py): the model's training FLOPs per token
    # (None: 4 N + 2 N_trainable from the parameters, 6 N when all train) and the device's peak
    # TFLOP/s (None: a table of known GPUs for 16-bit precisions).
    flops_per_token: float | None = None
    peak_tflops: float | None = None
    # Activations (docs/USAGE.md, "Activations"). activation_offload="on": the inputs that
    # checkpointed blocks keep between forward and backward go to the engine's page-locked host
    # memory during the forward and come back ahead of their backward; the same bits as "off".
    # activation_checkpointing="on": the engine runs the blocks of the model's nn.ModuleList under
    # non-reentrant checkpointing itself (a model that checkpoints itself keeps its own checkpoint);
    # "auto": it measures the blocks in the first forward and keeps, recomputes or (with offload on)
    # offloads each within the device room the chunks leave. activation_offload="auto" lets that
    # choice offload a block's input or not, also over the blocks a model checkpoints itself
    # (transformers' gradient checkpointing) with activation_checkpointing="off"; "on" offloads
    # every checkpointed block's input.
    activation_offload: str = "off"
    activation_checkpointing: str = "off"

    def unsupported_without_masters(self) -> str | None:
        """Why master_weights=False cannot be honoured with this precision (None: it can). Without
        fp32 masters a 16-bit parameter is stepped in place only as the 8-byte state: bf16
        parameters and bf16 moments, each rounded stochastically (Adam / AdamW)."""
        if self.master_weights or self.precision == "fp32":
            return None
        if self.precision == "bf16" and self.optimizer_state_dtype == "bf16":
            return None
        return (f"master_weights=False with precision={self.precision!r} and optimizer_state_dtype="
                f"{self.optimizer_state_dtype!r}: 16-bit parameters are stepped without fp32 masters only as the "
                "8-byte state (precision='bf16' with optimizer_state_dtype='bf16': bf16 parameters and moments "
                "rounded stochastically); set those two, or master_weights=True.")

    def _resolve_host_steps(self) -> None:
        """host_steps and its three aliases made to say the same, or a ValueError naming the two
        settings that disagree. An alias at its default says nothing."""
        said = []  # (the setting as written, the mode it means)
        if self.host_steps is not None:
            said.append((f"host_steps={self.host_steps!r}", self.host_steps))
        if not self.overlap_optimizer:
            said.append(("overlap_optimizer=False", "serial"))
        if self.optimizer_step_in_backward:
            said.append(("optimizer_step_in_backward=True", "in_backward"))
        if self.host_step_speculation != "in_place":
            mode = "at_step" if self.host_step_speculation == "off" else self.host_step_speculation
            said.append((f"host_step_speculation={self.host_step_speculation!r}", mode))
        for setting, mode in said[1:]:
            if mode != said[0][1]:
                raise ValueError(f"host_steps: {said[0][0]} and {setting} ask for different times to step the host's "
                                 f"chunk sets ({said[0][1]!r} and {mode!r}); set host_steps alone (one of "
                                 f"{', '.join(map(repr, HOST_STEPS_MODES))}).")
        mode = said[0][1] if said else "in_place"
        object.__setattr__(self, "host_steps", mode)
        object.__setattr__(self, "overlap_optimizer", mode != "serial")
        object.__setattr__(self, "optimizer_step_in_backward", mode == "in_backward")
        object.__setattr__(self, "host_step_speculation", {"at_step": "off", "spares": "spares"}.get(mode, "in_place"))

    def __post_init__(self):
        _choice("precision", self.precision, PRECISIONS)
        _choice("optimizer_state_dtype", self.optimizer_state_dtype, OPTIMIZER_STATE_DTYPES)
        _choice("placement_policy", self.placement_policy, PLACEMENT_POLICIES)
        _choice("device", self.device, DEVICES)
        _choice("activation_offload", self.activation_offload, ACTIVATION_OFFLOAD_MODES)
        _choice("activation_checkpointing", self.activation_checkpointing, ACTIVATION_CHECKPOINTING_MODES)
        _choice("host_step_speculation", self.host_step_speculation, HOST_STEP_SPECULATION_MODES)
        if self.host_steps is not None:
            _choice("host_steps", self.host_steps, HOST_STEPS_MODES)
        if self.chunk_init_device is not None:
            _choice("chunk_init_device", self.chunk_init_device, ("cuda", "sim", "cpu"))
        for name in ("shard_param_frac", "offload_optim_frac", "offload_param_frac"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: expected a fraction in [0, 1], got {value!r}. "
                                 f"Pass e.g. {name}=0.5.")
        for name in ("search_range_m", "min_chunk_size_m"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name}: expected a number >= 0 (units of 2**20 elements), got {value!r}.")
        for name in ("const_gpu_budget", "gpu_memory_limit", "sim_capacity"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, parse_bytes(value, name))
        for name, low in (("max_prefetch", 0), ("growth_interval", 1), ("hysteresis", 1), ("extra_dp_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}.")
        for name in ("initial_scale", "min_scale", "max_scale", "growth_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)!r}.")
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise ValueError(f"initial_scale: expected within [min_scale, max_scale] = [{self.min_scale}, "
                             f"{self.max_scale}], got {self.initial_scale}.")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"backoff_factor: expected in (0, 1), got {self.backoff_factor!r}.")
        if self.growth_factor <= 1.0:
            raise ValueError(f"growth_factor: expected > 1, got {self.growth_factor!r}.")
        for name in ("overlap_optimizer", "enable_async_reduce", "pin_memory", "master_weights",
                     "enable_gradient_accumulation", "cast_buffers", "optimizer_step_in_backward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected True or False, got {getattr(self, name)!r}.")
        for name in ("flops_per_token", "peak_tflops"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"{name}: expected a number > 0 or None (computed), got {value!r}.")
        if not self.max_norm >= 0.0:
            raise ValueError(f"max_norm: expected >= 0 (0 disables clipping), got {self.max_norm!r}.")
        self._resolve_host_steps()
        if self.optimizer_step_in_backward and (self.max_norm > 0 or self.precision == "fp16"):
            what = f"max_norm={self.max_norm}" if self.max_norm > 0 else "precision='fp16' (loss scaling)"
            raise ValueError(f"optimizer_step_in_backward=True steps the host-held state during backward, before the "
                             f"gradient norm is known; {what} needs that norm first. Use max_norm=0 and bf16/fp32, "
                             "or optimizer_step_in_backward=False.")
        if self.placement_policy == "const" and self.const_gpu_budget is None:
            raise ValueError("const_gpu_budget: placement_policy='const' needs a byte budget, got None. "
                             "Pass e.g. const_gpu_budget='8GiB'.")
        if (self.sim_capacity is not None and self.gpu_memory_limit is not None
                and self.gpu_memory_limit > self.sim_capacity):
            raise ValueError(f"gpu_memory_limit: expected at most the sim device's size (sim_capacity = "
                             f"{self.sim_capacity} bytes), got {self.gpu_memory_limit} bytes. On sim, as on cuda, "
                             "gpu_memory_limit is what the engine plans for within the device; lower it or raise "
                             "sim_capacity.")
        if self.chunk_config_dict is not None:
            object.__setattr__(self, "chunk_config_dict", _normalise_chunk_config(self.chunk_config_dict))

    def chunk_config_for(self, world_size: int) -> dict | None:
        """The {'chunk_size', 'keep_gathered'} to use at `world_size`, or None to search."""
        cfg = self.chunk_config_dict
        if cfg is None:
            return None
        if "chunk_size" in cfg:
            return cfg
        if world_size not in cfg:
            raise ValueError(f"chunk_config_dict: has entries for world sizes {sorted(cfg)}, not for {world_size}. "
                             "Add one or pass the flat form {'chunk_size': ..., 'keep_gathered': ...}.")
        return cfg[world_size]

    def replace(self, **overrides: Any) -> "GeminiConfig":
        if any(name in overrides for name in HOST_STEPS_FIELDS):
            # when the host steps: what the overrides say, not what this config resolved to
            overrides = {"host_steps": None, "overlap_optimizer": True, "host_step_speculation": "in_place",
                         "optimizer_step_in_backward": False, **overrides}
        return dataclasses.replace(self, **overrides)  # __init__ checks the names (check_field_names)


def check_field_names(given) -> None:
    """TypeError naming each name in `given` that is no GeminiConfig field, with the field it was
    probably meant to be."""
    known = [f.name for f in dataclasses.fields(GeminiConfig)]
    unknown = [name for name in given if name not in known]
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hints.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    raise TypeError(f"GeminiConfig has no field {', '.join(hints)}; the fields are: {', '.join(known)} "
                    "(README.md, Configuration).")


_dataclass_init = GeminiConfig.__init__


@functools.wraps(_dataclass_init)
def _checked_init(self, *args, **kwargs):
    check_field_names(kwargs)  # before the dataclass's own TypeError, which suggests nothing
    _dataclass_init(self, *args, **kwargs)


GeminiConfig.__init__ = _checked_init


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {value!r}.")


def _check_flat(entry: Any, where: str) -> dict:
    if not isinstance(entry, dict) or "chunk_size" not in entry:
        raise ValueError(f"{where}: expected {{'chunk_size': <elements>, 'keep_gathered': <bool>}}, got {entry!r}.")
    unknown = set(entry) - {"chunk_size", "keep_gathered"}
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: chunk_size, keep_gathered.")
    size = entry["chunk_size"]
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"{where}['chunk_size']: expected a positive number of elements, got {size!r}.")
    return {"chunk_size": size, "keep_gathered": bool(entry.get("keep_gathered", False))}


def _normalise_chunk_config(cfg: Any) -> dict:
    if isinstance(cfg, dict) and "chunk_size" in cfg:
        return _check_flat(cfg, "chunk_config_dict")
    if isinstance(cfg, dict) and cfg and all(isinstance(k, int) and not isinstance(k, bool) for k in cfg):
        return {k: _check_flat(v, f"chunk_config_dict[{k}]") for k, v in cfg.items()}
    raise ValueError("chunk_config_dict: expected {'chunk_size': <elements>, 'keep_gathered': <bool>} or "
                     f"{{world_size: {{...}}}}, got {cfg!r}.")
