"""CheckpointCalls: the engine takes part in the checkpoint calls a model makes for its layers, and
checks that torch saves a checkpoint's inputs where the offload can see them.

[Note: the checkpoint functions a model carries]
- transformers' layers checkpoint through a function each layer carries (`_gradient_checkpointing_func`,
  set by `gradient_checkpointing_enable()`, which the Trainer calls when training starts); the
  project's GPT `Checkpointed` blocks carry one too. The engine wraps that function on every
  module that has one, when enable() builds the activations and again at each forward's start
  (a function set later is wrapped before it runs), and close() puts the model's own back.
- A wrapped call goes to `route(module, checkpoint_fn, fn, args, kwargs)` (the package's blocks.py),
  which checkpoints it as the model asked, with the inputs offloaded where the plan says, or runs
  `fn` plainly where the plan keeps the block's activations.
- A model that calls torch.utils.checkpoint in its own code, outside both, is not seen: the room
  warns once where offload is on and a forward with grad saw no checkpoint call.

[Note: the mechanism check]
verify_mechanism() runs a checkpoint of two elements on the CPU under saved-tensor hooks: this
torch must save exactly the call's input outside the region (non-reentrant checkpointing saves its
inputs as saved tensors and shadows outer hooks inside; some releases save an empty placeholder
beside it). If it saves nothing there, or anything else, enable() raises naming the torch version
instead of offloading nothing in silence.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.utils.checkpoint

FUNCTION_ATTRIBUTE = "_gradient_checkpointing_func"


_checked: list = []  # the check's result once made in this process: [None] (passed) or [why not]


def verify_mechanism() -> None:
    """Raises RuntimeError where this torch's checkpoint does not save its inputs as the offload
    needs (the note above). Checked once per process, on a thread of its own: the checkpoint's
    frames form cycles, which must not keep the caller's frames (and an engine being built) alive."""
    if not _checked:
        result: list = []
        thread = threading.Thread(target=lambda: result.append(_mechanism_problem()), daemon=True)
        thread.start()
        thread.join()
        _checked.append(result[0] if result else "the check raised")
    if _checked[0] is not None:
        raise RuntimeError(_checked[0])


def _mechanism_problem() -> str | None:
    seen: list = []
    try:
        x = torch.arange(2.0, requires_grad=True)
        h = x * 2
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (seen.append(t), t)[1], lambda t: t):
            out = torch.utils.checkpoint.checkpoint(lambda t: (t * t).sin(), h, use_reentrant=False)
        out.sum().backward()
    except Exception as exc:  # noqa: BLE001  (any failure means the mechanism is not there)
        return (f"gemini_ext: activation offload could not check torch.utils.checkpoint on torch "
                f"{torch.__version__}: {exc!r}")
    is_input = [t.data_ptr() == h.data_ptr() and t.shape == h.shape for t in seen]
    # the input, and nothing of what the region computes (empty placeholders some releases save beside it)
    if any(is_input) and all(hit or t.numel() == 0 for hit, t in zip(is_input, seen)) and x.grad is not None:
        return None
    return (f"gemini_ext: activation offload needs torch.utils.checkpoint (use_reentrant=False) to save a "
            f"checkpoint's inputs as saved tensors at the call and nothing else outside its region; torch "
            f"{torch.__version__} saved {len(seen)} tensors there, not the input alone. Set "
            "activation_offload='off' (or use torch.autograd.graph.save_on_cpu yourself), or use a torch release "
            "the engine supports (python -m gemini_ext info).")


class CheckpointCalls:
    """Wraps the checkpoint function on every module of `model` that carries one (the note above)."""

    def __init__(self, model: torch.nn.Module, route):
        self._modules = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        self._route = route
        self.wrapped = 0  # functions wrapped so far (a function replaced by the model is wrapped again)

    def wrap(self) -> None:
        for module in self._modules:
            inner = module.__dict__.get(FUNCTION_ATTRIBUTE)
            if inner is None or getattr(inner, "gemini_inner", None) is not None:
                continue
            wrapper = functools.partial(self._call, module, inner)
            wrapper.gemini_inner = inner
            module.__dict__[FUNCTION_ATTRIBUTE] = wrapper
            self.wrapped += 1

    def _call(self, module, inner, fn, *args, **kwargs):
        return self._route(module, inner, fn, args, kwargs)

    def unwrap(self) -> None:
        for module in self._modules:
            wrapper = module.__dict__.get(FUNCTION_ATTRIBUTE)
            if (inner := getattr(wrapper, "gemini_inner", None)) is not None:
                module.__dict__[FUNCTION_ATTRIBUTE] = inner
