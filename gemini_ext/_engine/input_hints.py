"""What the engine does with a model's inputs, and the hint when they are the cause of an error.

[Note: inputs] The engine manages parameters, not inputs: it neither casts nor moves what the
model is called with, as FSDP and DDP do not. Parameters compute in the compute dtype
(GeminiConfig.precision) on the compute device, so floating inputs must be in that dtype (or the
forward run under torch.autocast) and every input on that device. When the forward raises and
an input differs in dtype or device, the exception gets a note naming the input, what it is, what
the parameters are and the fix; a forward that succeeds is not inspected.
"""

from __future__ import annotations

import sys

import torch
from torch.utils._pytree import tree_flatten

HINT_PREFIX = "gemini_ext: the engine does not cast or move a model's inputs"


def register(model: torch.nn.Module, compute_dtype: torch.dtype, compute_device: torch.device):
    # see [Note: inputs]
    """The root module's always-called forward hook that annotates a failed forward; returns its handle."""

    def annotate(module, args, kwargs, result):
        if result is not None:
            return None  # the forward succeeded
        exc = sys.exc_info()[1]
        if not isinstance(exc, Exception) or any(n.startswith(HINT_PREFIX) for n in getattr(exc, "__notes__", ())):
            return None  # no exception in flight, or an inner engine's hook said it already
        hint = describe_mismatch(args, kwargs, compute_dtype, compute_device, str(exc))
        if hint is not None:
            exc.add_note(hint)
        return None

    return model.register_forward_hook(annotate, with_kwargs=True, always_call=True)


def describe_mismatch(args, kwargs, compute_dtype: torch.dtype, compute_device: torch.device,
                      error: str = "") -> str | None:
    flat = tree_flatten((args, kwargs))[0]
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    autocast = torch.is_autocast_enabled(compute_device.type)
    wrong_dtype = [t for t in tensors if t.is_floating_point() and t.dtype != compute_dtype and not autocast]
    wrong_device = [t for t in tensors if t.device.type != compute_device.type]
    # Integer inputs are token ids for an Embedding as a rule; named only where the error is about
    # a dtype (a Long tensor reached a Linear layer, say).
    integer = [t for t in tensors if not t.is_floating_point() and not t.is_complex()] if "dtype" in error else []
    if not wrong_dtype and not wrong_device and not integer:
        return None
    parts = []
    if integer:
        found = sorted({str(t.dtype) for t in integer})
        parts.append(f"{len(integer)} integer input(s) in {', '.join(found)} where the error is about a dtype: a layer "
                     f"that computes with parameters (Linear, Conv) takes floating inputs in {compute_dtype} "
                     f"(x.to({compute_dtype})); token ids go to an Embedding")
    if wrong_dtype:
        found = sorted({str(t.dtype) for t in wrong_dtype})
        parts.append(f"{len(wrong_dtype)} floating input(s) in {', '.join(found)} while the managed parameters compute "
                     f"in {compute_dtype}: cast them (x.to({compute_dtype})) or run the forward under "
                     f"torch.autocast('{compute_device.type}', dtype={compute_dtype})")
    if wrong_device:
        found = sorted({str(t.device) for t in wrong_device})
        parts.append(f"{len(wrong_device)} input(s) on {', '.join(found)} while the parameters are on "
                     f"{compute_device}: move them (x.to(engine.compute_device))")
    return f"{HINT_PREFIX} (docs/USAGE.md, 'Inputs'); this forward got " + "; and ".join(parts) + "."
