"""engine.clip_grad_norm_: torch.nn.utils.clip_grad_norm_'s contract over gradients that live in chunks.

[Note: clipping without touching the gradients]
The total norm is taken over the gradient chunks now (the 2-norm from the per-chunk squared
sums HybridOptimizer keeps, any other p-norm from the gradients themselves; all-reduced or gathered
when sharded, so every rank gets the same figure) and returned as torch does, before clipping.
The coefficient min(1, max_norm / (norm + 1e-6)) is not applied to the chunks: it is folded into
the factor the next optimizer step reads every gradient with, exactly as `max_norm` is, so
clipping costs no pass over the gradients. A second call (or `max_norm` in the config) sees the
gradients as already clipped. A backward pass between the call and the step would add unclipped
gradients to clipped ones, which the folded factor cannot represent: the step then raises.
"""

from __future__ import annotations

import math

import torch


class GradClipper:
    """Handed the engine's parts (contract.EngineInternals): the manager, the loss scaler, the
    layout and the optimizer, read when a call comes (the optimizer is attached later)."""

    def __init__(self, parts):
        self._parts = parts
        self._coef = 1.0       # clipping factors of calls since the last step, multiplied
        self._backwards = None  # backward passes counted at the first such call
        self.clipped_last = False  # whether the last call scaled the gradients down

    def clip(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        # see [Note: clipping without touching the gradients]
        parts = self._parts
        max_norm = float(max_norm)
        norm_type = float(norm_type)
        if not max_norm >= 0.0:
            raise ValueError(f"engine.clip_grad_norm_(max_norm={max_norm}): expected max_norm >= 0.")
        gm = parts.runtime
        gm.flush_grads()
        scale = parts.scaler.scale if parts.scaler is not None else 1.0
        total = self._norm(norm_type) / scale * self._coef
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"engine.clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
                               f"non-finite ({total}), so it cannot be clipped. Set error_if_nonfinite=False to "
                               "skip this check.")
        coef = max_norm / (total + 1e-6)
        if coef < 1.0 and parts.config.optimizer_step_in_backward:
            raise RuntimeError(f"engine.clip_grad_norm_(max_norm={max_norm}): the gradients' norm is {total:.6g}, so "
                               "they would be scaled, but GeminiConfig(optimizer_step_in_backward=True) stepped the "
                               "host-held state during backward with them unscaled. Clip with "
                               "optimizer_step_in_backward=False, or only read the norm (max_norm=float('inf')).")
        self.clipped_last = coef < 1.0
        if self._backwards is None:
            self._backwards = gm.counters()["backward_passes"]
        if coef < 1.0:
            self._coef *= coef
        return torch.tensor(total, dtype=torch.float32, device=parts.device.torch_device)

    def _norm(self, norm_type: float) -> float:
        parts = self._parts
        if norm_type == 2.0 and parts.optimizer is not None:
            return math.sqrt(parts.optimizer.grad_norm_sq())
        # Any other order: from the gradients themselves (read_grad gathers when sharded).
        total = 0.0
        for i, p in enumerate(parts.layout.params):
            if not p.requires_grad or not parts.runtime.has_grad(i):
                continue
            g = parts.runtime.read_grad(i)
            if math.isinf(norm_type):
                total = max(total, float(g.abs().max())) if g.numel() else total
            else:
                total += float(g.abs().pow(norm_type).sum())
        return total if math.isinf(norm_type) else total ** (1.0 / norm_type)

    def take(self, backward_passes: int) -> float:
        """The factor the step folds in (1.0 without a call since the last step); raises if a
        backward pass ran after the call (`backward_passes`: the manager's count at the step)."""
        coef, backwards = self._coef, self._backwards
        self.reset()
        if backwards is not None and coef != 1.0 and backward_passes != backwards:
            raise RuntimeError("gemini_ext: a backward pass ran after engine.clip_grad_norm_() and before "
                               "optimizer.step(); its gradients would be added unclipped to clipped ones. Call "
                               "engine.clip_grad_norm_() after the last backward of the step (after gradient "
                               "accumulation), right before optimizer.step().")
        return coef

    def reset(self) -> None:
        self._coef = 1.0
        self._backwards = None
