"""Where the fp16 loss scale enters a backward pass: once per gradient, at the model's boundary.

[Note: the loss scale enters at the model's boundary]
`loss.backward()` must work unchanged, so the engine scales gradients where they cross into the
model rather than scaling the user's loss. A gradient hook on the model's own output tensors
fires once per tensor with the sum of every gradient that reaches it, including the gradient
that flows from one output to another inside the model: transformers' causal LMs return `loss`
computed from `logits`, so a hook on both scaled the loss path twice (scale**2: every fp16 step
overflowed and was skipped). Instead each floating output that requires grad is handed back as
a view of itself (an identity node) whose hook multiplies by the scale. The model's internal uses
of `logits` hold the original tensor, so only gradients from outside the model pass the identity
node: each is scaled exactly once, however many outputs the caller combines (two losses, a loss
plus an auxiliary or router loss, a loss and the logits). The identity node is a copy for tensors
of up to COPIED_NUMEL elements (losses, router logits): a caller may change those in place
(transformers' Trainer multiplies the loss in place), and an in-place change of a view rebases it
past the view's node, whose hook would then never fire, while a copy's node stays on the path. A
larger output (the logits) is a view, as copying it would cost its memory again.

Gradients that leave the model through its inputs (an `inputs_embeds` that requires grad, a model
applied to its own output, a module outside the engine that feeds it) pass an identity node on
each such input that divides by the scale, so the world outside the model sees true gradients and
a model fed its own outputs is not scaled twice.

Where the loss does not come from the model's outputs (Lightning's `training_step` calling a
submodule, a loss built from a tensor captured by a hook), the caller scales it: `engine.backward`
and the Lightning and Fabric plugins multiply the loss by the scale inside `caller_scales()`, and
the identity nodes pass gradients through unchanged for that backward. A backward in which
gradients reached managed parameters but no scale was applied on either path raises at its end
(the optimizer would otherwise divide unscaled gradients by the scale: a silent 1/scale step).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


COPIED_NUMEL = 1 << 20  # identity nodes of tensors up to this size copy them (see the note above)


class LossScaleBoundary:
    """The identity nodes on the model's inputs and outputs that apply the scaler's current scale
    (see the note above). `scale_fn()` returns the scale the next backward uses."""

    def __init__(self, scale_fn):
        self._scale_fn = scale_fn
        self._caller_depth = 0     # inside caller_scales(): the loss carries the scale already
        self._entries = 0          # gradients scaled on entry since the last backward ended
        self._unscaled = 0         # backward passes since zero_grad() that applied no scale
        self._handles = []

    def attach(self, model: torch.nn.Module) -> None:
        # see [Note: the loss scale enters at the model's boundary]
        self._handles.append(model.register_forward_pre_hook(self._wrap_inputs, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._wrap_outputs))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def caller_scales(self):
        """For a backward whose loss the caller multiplies by the yielded scale: the identity nodes
        leave its gradients alone."""
        self._caller_depth += 1
        self._entries += 1
        try:
            yield self._scale_fn()
        finally:
            self._caller_depth -= 1

    # --- the identity nodes ---------------------------------------------------------------------
    def _wrapped(self, tree, on_entry: bool):
        flat, spec = tree_flatten(tree)
        changed = False
        for k, t in enumerate(flat):
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
                node = t.clone() if t.numel() <= COPIED_NUMEL else t.view_as(t)
                node.register_hook(self._on_entry if on_entry else self._on_exit)
                flat[k] = node
                changed = True
        return tree_unflatten(flat, spec) if changed else None

    def _wrap_inputs(self, module, args, kwargs):
        if not torch.is_grad_enabled():
            return None
        return self._wrapped((args, kwargs), on_entry=False)

    def _wrap_outputs(self, module, args, output):
        if not torch.is_grad_enabled():
            return None
        return self._wrapped(output, on_entry=True)

    def _on_entry(self, grad):
        if self._caller_depth:
            return None
        self._entries += 1
        return grad * self._scale_fn()

    def _on_exit(self, grad):
        if self._caller_depth:
            return None
        return grad * (1.0 / self._scale_fn())

    # --- the end of a backward --------------------------------------------------------------------
    def end_backward(self, parameter_gradients: int) -> None:
        """Raises where `parameter_gradients` gradients reached managed parameters in a backward
        that applied no scale (see the note above)."""
        entries, self._entries = self._entries, 0
        if parameter_gradients and not entries:
            self._unscaled += 1
            raise RuntimeError(
                "gemini_ext: precision='fp16' scales the loss where gradients enter the model (its outputs), and "
                f"this backward reached {parameter_gradients} parameters without passing through any output of the "
                "model given to gx.enable (was the loss computed from a submodule's output or a tensor captured "
                "inside the model?). Its gradients are not scaled: optimizer.step() refuses them and zero_grad() "
                "drops them. Call engine.backward(loss) instead of loss.backward() (it scales the loss itself), "
                "compute the loss from the outputs of the model itself, or use precision='bf16'.")

    def check_step(self) -> None:
        """Raises where a backward since the last zero_grad() left unscaled gradients in the chunks."""
        if self._unscaled:
            raise RuntimeError(
                f"optimizer.step(): {self._unscaled} backward pass(es) since the last zero_grad() reached the "
                "parameters without the fp16 loss scale (the error raised at their end says why), so the gradients in "
                "the chunks are not what the step would divide by the scale. Call zero_grad() and run the backward "
                "with engine.backward(loss).")

    def reset(self) -> None:
        """zero_grad(): the gradients are gone, and with them any unscaled ones."""
        self._unscaled = 0
