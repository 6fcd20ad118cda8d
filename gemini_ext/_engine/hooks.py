"""Hook registration: Python registers, the C++ GeminiManager does the work (GIL released).

[Note: which hook does what]
- forward pre-hook of every module that directly owns managed parameters: fetch its chunks
  (`pre_forward`), and, when grad is enabled, route the tensor inputs through `_PostBackward`,
  an identity autograd Function whose backward runs once the module's backward is done
  (`post_backward`: its parameters that got no gradient yet go to HOLD_AFTER_BWD, so the chunk
  can be released during backward).
- forward hook: release the chunks (`post_forward`) and put a gradient hook on every output that
  requires grad: it fires before the module's backward and fetches the chunks again
  (`pre_backward`). Parameters used outside the forward of a module that owns them are not
  covered; tie weights by assigning the Parameter to both modules (as `GPT` does).
- post-accumulate-grad hook on every trainable parameter: copy the gradient into its chunk and
  clear `p.grad` (`post_accumulate_grad`).
- the first hook of a backward pass queues an end-of-backward callback with the autograd engine
  (`end_backward`: flushes chunks whose tensors got no gradient) and tells the optimizer that a
  backward began (it may arm speculative CPU steps: optim/wrapper.py). It also refuses what cannot
  work: a backward nested in another (reentrant activation checkpointing) and compiled autograd.

[Note: a backward that raised]
The autograd engine runs the queued end-of-backward callback only when the backward completes: an
exception inside it (a hook, a custom Function, an out-of-memory) leaves the manager in its
backward phase with the pass half done. The next thing that can only happen after that backward
ended finishes it the way it would have ended: a forward outside any backward, `zero_grad()` or
`optimizer.step()` (`finish_failed_backward`). The gradients that reached the chunks stay, as the
`.grad` of a plain model keeps what its failed backward accumulated; host steps started during
it are judged like any other (undone by `zero_grad()`).
"""

from __future__ import annotations

import functools
import sys
import time

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import input_hints


class _PostBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hooks, module_id, *inputs):
        ctx.hooks = hooks
        ctx.module_id = module_id
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.hooks.gm.post_backward(ctx.module_id)
        return (None, None) + grads


def _compiled_autograd_active() -> bool:
    if "torch._dynamo" not in sys.modules:  # compiled autograd is dynamo's: off until it is imported
        return False
    try:
        from torch._dynamo import compiled_autograd
    except Exception:  # torch without dynamo
        return False
    return bool(getattr(compiled_autograd, "in_compiled_autograd_region", False)) or \
        bool(getattr(compiled_autograd, "compiled_autograd_enabled", False))


class HookSet:
    """All hooks of one engine; `remove()` takes them off again."""

    def __init__(self, gm, model: torch.nn.Module, params: list, loss_scale=None, on_backward_start=None,
                 on_forward_start=None):
        self.gm = gm
        self._on_backward_start = on_backward_start
        self._handles = []
        if on_forward_start is not None:  # before any chunk is fetched (writes between steps land first)
            self._handles.append(model.register_forward_pre_hook(
                lambda module, args: self._forward_started(on_forward_start), prepend=True))
        self._graph_task = None  # id of the backward pass the end callback is queued for
        # Host wall times of the last forward (its start to the backward's) and backward pass.
        self._forward_began = self._backward_began = 0.0
        self.last_forward_seconds = self.last_backward_seconds = 0.0
        self._loss_scale = loss_scale  # fp16: loss_scale_boundary.LossScaleBoundary, else None
        self._grads_this_backward = 0  # parameter gradients the current backward delivered
        index = {id(p): i for i, p in enumerate(params)}
        self._root = model
        self._modules = {}  # module id in the manager -> (module, its pre-hook and forward hook handles)
        for module in model.modules():
            own = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
            if own:
                self._hook_module(gm.register_module(own), module)
        self.module_hooks_off = False
        for i, p in enumerate(params):
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._post_accumulate, i)))
        if loss_scale is not None:
            loss_scale.attach(model)
        if params:  # a failed forward whose inputs differ in dtype or device from the parameters says so
            self._handles.append(input_hints.register(model, params[0].dtype, params[0].device))

    def _hook_module(self, mid: int, module: torch.nn.Module) -> None:
        self._modules[mid] = (module, module.register_forward_pre_hook(functools.partial(self._pre_forward, mid)),
                              module.register_forward_hook(functools.partial(self._post_forward, mid)))

    def set_module_hooks_off(self, off: bool) -> None:
        """Takes the chunk hooks off every module but the root (`off`), or puts them back: a
        generation whose parameter chunks are all held on the device computes as the model alone
        (see [Note: a generation with every parameter resident], generation.py). Called at the root's
        forward start, where only the modules below it are still to be called."""
        if off == self.module_hooks_off:
            return
        for mid, (module, *handles) in list(self._modules.items()):
            if module is self._root:
                continue
            if off:
                for h in handles:
                    h.remove()
            else:
                self._hook_module(mid, module)
        self.module_hooks_off = off

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for _, *handles in self._modules.values():  # a handle already removed (hooks off) removes nothing
            for h in handles:
                h.remove()
        self._modules.clear()
        self.module_hooks_off = False
        if self._loss_scale is not None:
            self._loss_scale.remove()

    # --- forward ---------------------------------------------------------------------------
    def _pre_forward(self, mid, module, args):
        if self._graph_task is not None:
            self.finish_failed_backward()
        self.gm.pre_forward(mid)
        if not torch.is_grad_enabled():
            return None
        flat, spec = tree_flatten(args)
        where = [k for k, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not where:
            return None  # no input gradient: the end-of-backward callback covers this module
        routed = _PostBackward.apply(self, mid, *[flat[k] for k in where])
        for k, t in zip(where, routed):
            flat[k] = t
        return tree_unflatten(flat, spec)

    def _post_forward(self, mid, module, args, output):
        self.gm.post_forward(mid)
        if not torch.is_grad_enabled():
            return None
        hook = functools.partial(self._pre_backward, mid)
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(hook)
        return None

    # --- backward --------------------------------------------------------------------------
    def _backward_started(self) -> None:
        task = torch._C._current_graph_task_id()
        if _compiled_autograd_active():
            raise RuntimeError("gemini_ext: compiled autograd is not supported (the chunk hooks must run eagerly "
                               "during backward); run backward without torch._dynamo.compiled_autograd.")
        if self._graph_task is None:
            if self._on_backward_start is not None:
                self._on_backward_start()  # may refuse the backward: then nothing of it is recorded
            self._graph_task = task
            self._backward_began = time.perf_counter()
            if self._forward_began:
                self.last_forward_seconds = self._backward_began - self._forward_began
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        elif task != self._graph_task:
            raise RuntimeError("gemini_ext: a backward pass started inside another one. This is what reentrant "
                               "activation checkpointing does, which gemini_ext does not support: use "
                               "torch.utils.checkpoint.checkpoint(..., use_reentrant=False).")

    def _pre_backward(self, mid, grad):
        self._backward_started()
        self.gm.pre_backward(mid)
        return None

    def _post_accumulate(self, index, param):
        self._backward_started()
        self._grads_this_backward += 1
        self.gm.post_accumulate_grad(index, param)

    def _forward_started(self, on_forward_start) -> None:
        if self._graph_task is not None:
            self.finish_failed_backward()
        self._forward_began = time.perf_counter()
        on_forward_start()

    def last_pass_seconds(self) -> dict:
        """{"forward_seconds", "backward_seconds"} of the last iteration (the MemoryTracer's)."""
        return {"forward_seconds": self.last_forward_seconds, "backward_seconds": self.last_backward_seconds}

    def finish_failed_backward(self) -> bool:
        """Ends a backward that raised before its end callback ran; True if there was one. Inside a
        backward (a recomputing forward) it does nothing."""
        # see [Note: a backward that raised]
        if self._graph_task is None or torch._C._current_graph_task_id() != -1:
            return False
        self._end_backward(failed=True)
        return True

    def _end_backward(self, failed: bool = False):
        self._graph_task = None
        grads, self._grads_this_backward = self._grads_this_backward, 0
        self.gm.end_backward()
        self.last_backward_seconds = time.perf_counter() - self._backward_began
        if self._loss_scale is not None:  # raises where nothing applied the fp16 scale
            self._loss_scale.end_backward(0 if failed else grads)
