"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") as a torch optimizer.

torch has no Lion, so gemini_ext provides one: `gx.optim.Lion` works on any model like a torch
optimizer (a foreach implementation; foreach=False steps tensor by tensor), and
`engine.optimizer(gx.optim.Lion, ...)` steps the chunks with the native kernels. Per parameter,
with g its gradient and m its one state ("exp_avg"):
    update = sign(beta1 * m + (1 - beta1) * g)
    p      = p * (1 - lr * weight_decay) - lr * update      (decoupled weight decay)
    m      = beta2 * m + (1 - beta2) * g
"""

from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas: tuple = (0.9, 0.99), weight_decay: float = 0.0,
                 foreach: bool | None = None):
        if not lr >= 0.0:
            raise ValueError(f"Lion: lr must be >= 0, got {lr}.")
        if not (0.0 <= betas[0] <= 1.0 and 0.0 <= betas[1] <= 1.0):
            raise ValueError(f"Lion: betas must be in [0, 1], got {betas}.")
        if not weight_decay >= 0.0:
            raise ValueError(f"Lion: weight_decay must be >= 0, got {weight_decay}.")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay, "foreach": foreach})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("Lion does not support sparse gradients.")
            grads = [p.grad for p in params]
            avgs = [self.state[p].setdefault("exp_avg", torch.zeros_like(p)) for p in params]
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            if group["foreach"] is False:  # tensor by tensor (e.g. FSDP2's DTensors)
                for p, g, m in zip(params, grads, avgs):
                    update = m.mul(beta1).add_(g, alpha=1 - beta1).sign_()
                    if wd != 0:
                        p.mul_(1 - lr * wd)
                    p.add_(update, alpha=-lr)
                    m.mul_(beta2).add_(g, alpha=1 - beta2)
                continue
            updates = torch._foreach_mul(avgs, beta1)
            torch._foreach_add_(updates, grads, alpha=1 - beta1)
            torch._foreach_sign_(updates)
            if wd != 0:
                torch._foreach_mul_(params, 1 - lr * wd)
            torch._foreach_add_(params, updates, alpha=-lr)
            torch._foreach_mul_(avgs, beta2)
            torch._foreach_add_(avgs, grads, alpha=1 - beta2)
        return loss
