"""Throughput and model FLOP utilisation (MFU) of the iterations an engine runs.

[Note: what MFU counts]
- Tokens: the model's forward, with gradients enabled, counts the elements of its token ids (an
  `input_ids` argument, else the first integer tensor it is given); the forwards of one iteration
  (between optimizer steps: micro-batches of gradient accumulation) add up. Forwards without
  gradients (evaluation) and the recomputation of activation checkpointing (which does not call
  the model's own forward again) are not counted.
- FLOPs per token: 2 per parameter for the forward, 2 for the backward's input gradients and 2
  more for each trainable parameter's weight gradient: 4 N + 2 N_trainable, which is the usual
  6 N when every parameter trains (attention's score FLOPs and recomputation are not credited).
  `GeminiConfig(flops_per_token=...)` replaces it (a model with other costs, or to count attention).
- The step time is the wall time from one optimizer step to the next (the first: from the first
  counted forward), so data loading and the CPU optimizer time the step does not hide count.
- Peak: the dense 16-bit tensor-core rate of a known GPU (the table below), or
  `GeminiConfig(peak_tflops=...)`; none on sim or for an unknown device, and then no MFU.
MFU = tokens/s x FLOPs per token / peak, per rank (each rank counts its own tokens and GPU).
"""

from __future__ import annotations

import time

import torch

# Dense bf16/fp16 tensor-core TFLOP/s by device name (torch.cuda.get_device_name), first match.
PEAK_16BIT_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("GH200", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("V100", 125.0),
)
HISTORY = 100
TIMED_STEPS = 10  # the median over the last ones (the first, a warm-up, excluded)


def model_flops_per_token(params: list) -> float:
    """4 N + 2 N_trainable (the note above); tied parameters are listed once."""
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return float(4 * total + 2 * trainable)


def peak_tflops_of(device: torch.device, precision: str) -> tuple[float | None, str]:
    """The device's dense tensor-core peak for 16-bit compute and where it came from."""
    if device.type != "cuda":
        return None, "none off a GPU (sim)"
    if precision not in ("bf16", "fp16"):
        return None, f"none for precision={precision!r} (pass GeminiConfig(peak_tflops=...))"
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_16BIT_TFLOPS:
        if key in name:
            return tflops, f"table ({name})"
    return None, f"unknown device {name!r} (pass GeminiConfig(peak_tflops=...))"


def _tokens_in(args, kwargs) -> int | None:
    value = kwargs.get("input_ids") if kwargs else None
    if isinstance(value, torch.Tensor):
        return value.numel()
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, torch.Tensor) and not a.is_floating_point() and not a.is_complex() and a.dtype != torch.bool:
            return a.numel()
    return None


class Throughput:
    """Counts the tokens of each iteration and times it (see the note above)."""

    def __init__(self, model: torch.nn.Module, params: list, config, device: torch.device):
        if config.flops_per_token is not None:
            self.flops_per_token, self.flops_source = float(config.flops_per_token), "config"
        else:
            self.flops_per_token, self.flops_source = model_flops_per_token(params), "4 N + 2 N_trainable"
        if config.peak_tflops is not None:
            self.peak_tflops, self.peak_source = float(config.peak_tflops), "config"
        else:
            self.peak_tflops, self.peak_source = peak_tflops_of(device, config.precision)
        self._tokens = 0
        self._began = None  # when the iteration now running began (its first counted forward, or the last step)
        self.steps = []  # (tokens, seconds) per iteration
        self._handle = model.register_forward_pre_hook(self._forward, with_kwargs=True)

    def remove(self) -> None:
        self._handle.remove()

    def _forward(self, module, args, kwargs):
        if not torch.is_grad_enabled():
            return None
        tokens = _tokens_in(args, kwargs)
        if tokens is not None:
            if self._began is None:
                self._began = time.perf_counter()
            self._tokens += tokens
        return None

    def end_iteration(self) -> None:
        now = time.perf_counter()
        if self._began is not None:
            self.steps.append((self._tokens, now - self._began))
            del self.steps[:-HISTORY]
        self._tokens, self._began = 0, now

    def summary(self) -> dict:
        """engine.stats()["throughput"]: over the last iterations (the first excluded when there
        are others), the median step and its tokens, tokens/s, model TFLOP/s and MFU."""
        out = {"flops_per_token": self.flops_per_token, "flops_per_token_source": self.flops_source,
               "peak_tflops": self.peak_tflops, "peak_source": self.peak_source,
               "steps_timed": 0, "tokens_per_step": None, "step_seconds": None, "tokens_per_s": None,
               "model_tflops_per_s": None, "mfu": None}
        timed = self.steps[1:] if len(self.steps) > 1 else self.steps
        timed = [s for s in timed[-TIMED_STEPS:] if s[1] > 0 and s[0] > 0]
        if not timed:
            return out
        # The median of the steps' rates: a step is timed from one optimizer step to the next, so
        # the work after the last step() of a window falls in the next one; a mean over a short
        # window would carry the first step's remainder (auto's re-placement, a short tail).
        rates = sorted(t / s for t, s in timed)
        per_s = rates[len(rates) // 2]
        tokens = sum(t for t, _ in timed)
        achieved = per_s * self.flops_per_token / 1e12
        out.update(steps_timed=len(timed), tokens_per_step=tokens / len(timed),
                   step_seconds=sorted(s for _, s in timed)[len(timed) // 2], tokens_per_s=per_s,
                   model_tflops_per_s=achieved,
                   mfu=achieved / self.peak_tflops if self.peak_tflops else None)
        return out
