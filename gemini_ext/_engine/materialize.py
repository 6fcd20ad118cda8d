"""Models built on the meta device: storage and initial values, one module group at a time, as
enable() reaches them.

[Note: models too large to build anywhere]
Sharded, every rank starts enable() with a whole model and keeps a shard of it. An 80B model in
fp32 is 324 GB: no GPU holds it, and eight ranks' host copies would not fit the host either. Built
under `torch.device("meta")`, the model has shapes and no storage; enable() gives a module's
tensors storage on the compute device only when it reaches the module's first parameter, runs the
initialiser on it, writes the values into this rank's shards and releases them before going on.
At any moment only the modules being written hold full tensors.
- Parameter objects keep their identity (torch.utils.swap_tensors): the engine's references, the
  caller's and ties between modules (a shared embedding and output head) all see the new storage.
- Modules that share a meta tensor form one group and are materialised and initialised together,
  before any of the group's parameters is written and released (an initialiser never sees a
  released tensor).
- The initialiser is called once per module that owns meta tensors directly (recurse=False), with
  the module's tensors already on the device and uninitialised: the default calls
  `module.reset_parameters()`, which torch's layers define; a module without one needs a
  `param_init_fn`. Buffers are the initialiser's job too (reset_parameters sets them for torch's
  layers that have any).
- Several ranks run the same initialiser; enable() still broadcasts rank 0's values, so ranks
  whose random streams differ train one model.
"""

from __future__ import annotations

from typing import Callable

import torch

from .._native import _C


def reset_parameters(module: torch.nn.Module) -> None:
    """The default initialiser: the module's own reset_parameters()."""
    module.reset_parameters()


def _direct_meta_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    tensors = list(module._parameters.items()) + list(module._buffers.items())
    return [(key, t) for key, t in tensors if t is not None and t.is_meta]


class MetaMaterializer:
    """Gives a meta-built model's tensors storage on `device`, group by group (see the note)."""

    def __init__(self, model: torch.nn.Module, device: torch.device,
                 param_init_fn: Callable[[torch.nn.Module], None] | None):
        self.device = device
        self.init_fn = param_init_fn or reset_parameters
        owners: dict[int, list[int]] = {}  # id(meta tensor) -> indices of the modules that own it
        self._modules: list[tuple[str, torch.nn.Module]] = []
        for name, module in model.named_modules():
            direct = _direct_meta_tensors(module)
            if direct:
                for _, t in direct:
                    owners.setdefault(id(t), []).append(len(self._modules))
                self._modules.append((name, module))
        # modules sharing a meta tensor: one group (union-find over module indices)
        parent = list(range(len(self._modules)))

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for shared in owners.values():
            for other in shared[1:]:
                parent[root(other)] = root(shared[0])
        self._groups: dict[int, list[int]] = {}  # root module index -> member module indices
        for i in range(len(self._modules)):
            self._groups.setdefault(root(i), []).append(i)
        self._group_of_tensor = {t: root(shared[0]) for t, shared in owners.items()}
        self._done: set[int] = set()
        if param_init_fn is None:
            missing = [f"{name or '<root>'} ({type(m).__name__})" for name, m in self._modules
                       if not callable(getattr(m, "reset_parameters", None))]
            if missing:
                raise ValueError(
                    f"enable(): the model was built on the meta device and {len(missing)} module(s) owning meta "
                    f"tensors have no reset_parameters() to initialise them: {', '.join(missing[:5])}"
                    f"{' ...' if len(missing) > 5 else ''}. Pass enable(..., param_init_fn=fn), where fn(module) "
                    "initialises the module's own parameters and buffers in place, or build the model on a real "
                    "device.")

    def __bool__(self) -> bool:
        return bool(self._modules)

    @property
    def materialized_modules(self) -> int:
        return sum(len(self._groups[g]) for g in self._done)

    def materializes(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` was built on meta and gets its storage and values here (its identity
        survives materialisation)."""
        return id(tensor) in self._group_of_tensor

    def ensure(self, tensor: torch.Tensor) -> None:
        """Materialises the group owning `tensor` if it is still on the meta device."""
        if tensor.is_meta:
            group = self._group_of_tensor.get(id(tensor))
            if group is None:
                raise _C.InternalError("gemini_ext internal error (this is a bug, please report it): a meta tensor "
                                   "that no module of the model owns directly.")
            self._materialize(group)

    def materialize_rest(self) -> None:
        # see [Note: models too large to build anywhere]
        """Groups enable() never reached through a parameter (modules with meta buffers only)."""
        for group in self._groups:
            self._materialize(group)

    def _materialize(self, group: int) -> None:
        if group in self._done:
            return
        self._done.add(group)
        members = [self._modules[i] for i in self._groups[group]]
        for _, module in members:
            for _, t in _direct_meta_tensors(module):
                if not t.is_meta:  # shared with a member already given storage
                    continue
                if isinstance(t, torch.nn.Parameter):
                    new = torch.nn.Parameter(torch.empty_like(t, device=self.device), requires_grad=t.requires_grad)
                else:
                    new = torch.empty_like(t, device=self.device)
                torch.utils.swap_tensors(t, new)
        with torch.no_grad():
            for name, module in members:
                self.init_fn(module)
                still = [key for key, t in _direct_meta_tensors(module)]
                if still:
                    raise RuntimeError(f"enable(): param_init_fn left {name or '<root>'}.{still[0]} on the meta "
                                       "device; it must initialise the module's tensors in place, not replace them.")
