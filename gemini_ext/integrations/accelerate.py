"""Accelerate: a user's own `accelerate` loop with the model under a gemini_ext engine.

[Note: what the Accelerator keeps and what the engine takes]
`prepare(accelerator, engine)` is the one line to add after `gx.enable`: the Accelerator keeps
the data loader, the scheduler, gradient accumulation (`accelerator.accumulate`), `backward` and
its process state; the engine keeps the parameters, so
- `accelerator.prepare(model)` hands the engine's model back unchanged (no device move, no
  DistributedDataParallel: the engine places, shards and reduces itself);
- `accelerator.clip_grad_norm_` clips in the gradient chunks (accelerate reads `p.grad`, which is
  None for managed parameters: without this it would report 0 and clip nothing);
- the optimizer is the engine's (`engine.optimizer(...)`), prepared as any optimizer; preparing it
  tells it the Accelerator's `gradient_accumulation_steps`, as the Trainer and Lightning do, so
  that the host steps start during the last backward of each step from the first step on (not
  during an earlier one, taken back when the next adds to the gradients).
Saving: `accelerator.save_state(dir)` stores the optimizer's torch-format state and the
scheduler, but not the engine's masters as the engine keeps them; `engine.save_checkpoint(dir)`
(beside it, on every rank) and `engine.load_checkpoint(dir)` after `accelerator.load_state(dir)`
resume bit-exactly.
"""

from __future__ import annotations

import torch

from .._engine import registry


def clip_grad_norm_in_chunks(parameters, max_norm, norm_type=2):
    """accelerate's clip_grad_norm_ for managed parameters: torch's clip_grad_norm_, which is the
    engine's while it is open (it checks that the parameters are the model's, then clips in the
    chunks)."""
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)


def prepare(accelerator, engine) -> None:
    # see [Note: what the Accelerator keeps and what the engine takes]
    """Makes `accelerator` leave `engine`'s model to the engine (see the Note above)."""
    if not registry.is_open_engine(engine):
        raise ValueError("gemini_ext.integrations.accelerate.prepare(accelerator, engine): `engine` must be an open "
                         "engine (the result of gx.enable(model, config), inside its block).")
    model = engine.model
    original_prepare_model = accelerator.prepare_model

    def prepare_model(m, device_placement=None, evaluation_mode=False):
        if m is model:
            return m  # placed, sharded and reduced by the engine
        return original_prepare_model(m, device_placement=device_placement, evaluation_mode=evaluation_mode)

    original_prepare_optimizer = accelerator.prepare_optimizer

    def prepare_optimizer(optimizer, device_placement=None):
        if getattr(optimizer, "engine", None) is engine:  # this engine's GeminiOptimizer
            optimizer.expect_backwards_per_step(int(accelerator.gradient_accumulation_steps))
        return original_prepare_optimizer(optimizer, device_placement=device_placement)

    accelerator.prepare_model = prepare_model
    accelerator.prepare_optimizer = prepare_optimizer
    accelerator.clip_grad_norm_ = clip_grad_norm_in_chunks
