"""EngineParts: the parts one engine is made of, as its other modules see them (contract.EngineInternals).

enable() builds the parts in order (_engine/build.py) and assigns them here; the facade
(gemini_ext/engine.py) keeps the user's API and delegates. The iteration boundary lives here
because the optimizer's step calls it: the manager closes its access trace and reports once, the tracer records the
iteration from that report and the placer decides again from it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TrainingCounters:
    optimizer_steps: int = 0  # fp16 steps skipped for overflow: the loss scaler counts them
    step_call_seconds: float = 0.0  # the last optimizer.step()'s wall time: what its caller waited


class EngineParts:
    """Set by enable() as each part is built; see contract.EngineInternals for what each is."""

    def __init__(self, config, compute_dtype):
        self.config = config
        self.compute_dtype = compute_dtype
        self.counters = TrainingCounters()
        self.optimizer = None
        self.closed = False
        self.groups = self.device = self.layout = self.chunks = self.runtime = None
        self.placer = self.tracer = self.throughput = self.access = self.sharded_state = self.clipper = None
        self.scaler = self.hooks = self.buffers = self.chunk_size = None
        self.loss_scale = None  # fp16: where the scale enters backward (loss_scale_boundary.py)
        self.zero_comm = self.replica_comm = None  # the communicators over the process groups (sharded)
        self.activations = None  # activations.ActivationManager, as the config asks
        self.phases = None  # phases.StatePhases: the states offloaded between training phases, and back
        self.generation = None  # generation.GenerationBudget: the KV cache's room inside engine.generating()

    def check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"engine.{what}(): the engine is closed (its `with` block has ended); call "
                               "gx.enable(model, config) again.")

    def attach_optimizer(self, opt) -> None:
        if self.optimizer is not None:
            raise RuntimeError("engine.optimizer(): this engine already has an optimizer; the optimizer state lives "
                               "in the engine's chunks, so there can be only one. Reuse the first one.")
        self.optimizer = opt

    def detach_optimizer(self, opt) -> None:
        if self.optimizer is opt:
            self.optimizer = None

    def check_no_stray_grads(self) -> None:
        for name, p in zip(self.layout.names, self.layout.params):
            if p.grad is not None:
                raise RuntimeError(f"gemini_ext: parameter {name!r} has a .grad that did not go into its chunk (was "
                                   "requires_grad changed after gx.enable, or .grad assigned by hand?). Set "
                                   "requires_grad before gx.enable; gradients must come from backward.")

    def check_no_steps_in_backward(self, what: str) -> None:
        """Raises where the last backward stepped host chunk sets in place (the step in backward)
        and `what` would leave them without the optimizer.step() that completes the step."""
        stepped = self.optimizer.steps_started_in_backward() if self.optimizer is not None else 0
        if stepped:
            raise RuntimeError(
                f"gemini_ext: {what} after a backward pass that stepped {stepped} chunk sets in place "
                "(GeminiConfig(optimizer_step_in_backward=True)): their parameters and optimizer state already "
                "changed, and only optimizer.step() completes the step for the others. Call optimizer.step() "
                "before it, or set optimizer_step_in_backward=False to be able to drop a step's gradients.")

    def zero_grad(self) -> None:
        """Clears every gradient chunk and the clipping noted since the last step (engine.zero_grad,
        optimizer.zero_grad, model.zero_grad)."""
        self.hooks.finish_failed_backward()
        self.check_no_steps_in_backward("zero_grad()")
        self.runtime.zero_grad()
        self.clipper.reset()
        if self.loss_scale is not None:
            self.loss_scale.reset()

    def end_iteration(self) -> dict:
        self.hooks.finish_failed_backward()
        report = self.runtime.end_iteration()
        self.tracer.end_iteration(report, self.hooks.last_pass_seconds())
        self.placer.after_iteration(self.runtime, self.tracer, report)
        if self.activations is not None:  # after the placement: activations take the room chunks leave
            self.activations.after_iteration()
        self.throughput.end_iteration()  # after the policy: chunks it moves count to this iteration
        return report
