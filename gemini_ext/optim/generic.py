"""The generic rule: any torch.optim.Optimizer stepping views of the chunks.

[Note: stepping a torch optimizer over chunk views]
Native rules (Adam, SGD, Lion, Adagrad) step whole chunk runs with fused kernels. Every other
torch.optim.Optimizer class (RMSprop, NAdam, Adafactor, a Muon implementation, ...) is built over
*proxies*: one fp32 tensor per managed parameter, of the parameter's shape, that the optimizer
sees as its parameter. At each step the C++ HybridOptimizer walks the chunk sets in forward
order; for each set, in the caller's thread and on the tier where the set's master lives, it
calls `step_set`, which points every proxy of the set at its slice of the fp32 master chunk
(`proxy.data`), gives it its gradient (a slice of the gradient chunk, in fp32, times the step's
multiplier: loss scale and clipping), and calls the optimizer's `step()`; HybridOptimizer then
rewrites the 16-bit parameters from the masters. Per-tensor and matrix-shaped updates
(Adafactor's factored moments, LAMB-style trust ratios, Muon's orthogonalisation) see the true
shapes. Sharded over ranks, a rank holds only a shard of each chunk, so the set's master and
gradient shards are all-gathered first, every rank steps the whole set (the same inputs, the same
result) and keeps its own shard: the optimizer's state is then whole on every rank.
The costs, against a native rule: no fused SIMD kernel, no overlap of host steps with the next
forward, no speculation; the optimizer's state is allocated by torch beside the master and does
not move between tiers, so the placement chosen at enable() stays (the auto policy makes no
later decision); `step()` is called once per chunk set, so an optimizer that counts calls to
step() outside its per-parameter state sees one call per set.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _placeholder(shape, device) -> torch.Tensor:
    """A tensor of `shape` on `device` holding one element (zero strides)."""
    return torch.empty_strided(tuple(shape), (0,) * len(shape), dtype=torch.float32, device=device)


class GenericStepper:
    """The user's optimizer over proxies of `groups`' parameters (see the note above)."""

    def __init__(self, parts, opt_cls, groups: list[dict], kwargs: dict):
        self._parts = parts  # the engine's parts (_engine/contract.py): layout, manager, groups, device
        layout = parts.layout
        set_of_param = layout.set_of_param()
        placements = parts.runtime.set_placements()
        self._proxies = {}  # engine parameter index -> proxy
        self._home = {}     # proxy -> the device of its master's tier
        proxy_groups = []
        for g in groups:
            proxies = []
            for p in g["params"]:
                idx = layout.index(p)
                on_host = placements[set_of_param[idx]]["optim_on_host"]
                home = torch.device("cpu") if on_host else parts.device.torch_device
                proxy = _placeholder(p.shape, home)
                self._proxies[idx] = proxy
                self._home[proxy] = home
                proxies.append(proxy)
            proxy_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": proxies})
        try:
            self.optimizer = opt_cls(proxy_groups, **kwargs)
        except TypeError as exc:
            raise TypeError(f"gemini_ext optimizer: {opt_cls.__name__} is stepped generically, built as "
                            f"{opt_cls.__name__}(param_groups, **{sorted(kwargs)}) over the parameters, and that "
                            f"failed: {exc}") from exc

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def sync_hyperparameters(self, groups: list[dict]) -> None:
        """Our param_groups' values (an LR scheduler edits those) into the optimizer's groups."""
        for mine, inner in zip(groups, self.optimizer.param_groups):
            for k, v in mine.items():
                if k != "params":
                    inner[k] = v

    def step_set(self, set_index: int, master: torch.Tensor, grad: torch.Tensor, params: list, multiplier: float):
        # see [Note: stepping a torch optimizer over chunk views]
        """Called by the C++ HybridOptimizer for one chunk set (see the note above)."""
        parts = self._parts
        sharded = parts.groups.world_size > 1
        if sharded:
            whole_master, whole_grad = self._gather(master), self._gather(grad)
        else:
            whole_master, whole_grad = master, grad
        used = []
        try:
            with torch.no_grad():
                for idx in params:
                    proxy = self._proxies.get(idx)
                    if proxy is None:
                        continue
                    offset, numel = parts.layout.offset_in_chunk(idx)
                    shape = parts.layout.params[idx].shape
                    proxy.data = whole_master[offset:offset + numel].view(shape)
                    g = whole_grad[offset:offset + numel].view(shape)
                    if g.dtype != torch.float32 or multiplier != 1.0:
                        g = g.to(torch.float32).mul_(multiplier)
                    proxy.grad = g
                    used.append(proxy)
            if used:
                self.optimizer.step()
        finally:
            for proxy in used:
                proxy.grad = None
                proxy.data = _placeholder(proxy.shape, self._home[proxy])
        if sharded:
            shard = master.numel()
            master.copy_(whole_master[parts.groups.rank * shard:(parts.groups.rank + 1) * shard])

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        """This set's whole chunk from every rank's shard (on the backend's device, then back)."""
        group = self._parts.groups.zero
        device = torch.device("cpu") if dist.get_backend(group) == "gloo" else self._parts.device.torch_device
        local = shard.to(device)
        whole = torch.empty(local.numel() * self._parts.groups.world_size, dtype=local.dtype, device=device)
        dist.all_gather_into_tensor(whole, local.contiguous(), group=group)
        return whole.to(shard.device)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)  # the state goes to each proxy's home device
