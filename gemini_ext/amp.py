"""Dynamic loss scaling for fp16 (the GeminiConfig scaler fields).

[Note: loss scaling without touching the user's loss]
`loss.backward()` must work unchanged, so the engine scales the gradient where it enters the
model, once per gradient (_engine/loss_scale_boundary.py). Parameter gradients are therefore
scaled by `scale`; the optimizer divides by it (folded into the CPU Adam's gradient factor, no
extra pass) after checking the global norm for inf/NaN. An overflow skips the step (counted
here, in `skipped_steps`) and counts against `hysteresis`: after `hysteresis` consecutive
overflows the scale is multiplied by `backoff_factor` (not below `min_scale`); `growth_interval`
clean steps in a row multiply it by `growth_factor` (not above `max_scale`).
"""

from __future__ import annotations


class DynamicLossScaler:
    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float, backoff_factor: float,
                 growth_interval: int, hysteresis: int, max_scale: float):
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._overflows_in_a_row = 0
        self._clean_steps = 0
        self.skipped_steps = 0

    @classmethod
    def from_config(cls, config) -> "DynamicLossScaler":
        return cls(config.initial_scale, config.min_scale, config.growth_factor, config.backoff_factor,
                   config.growth_interval, config.hysteresis, config.max_scale)

    def update(self, found_inf: bool) -> None:
        # see [Note: loss scaling without touching the user's loss]
        if found_inf:
            self.skipped_steps += 1
            self._clean_steps = 0
            self._overflows_in_a_row += 1
            if self._overflows_in_a_row >= self.hysteresis:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self._overflows_in_a_row = 0
        else:
            self._clean_steps += 1
            if self._clean_steps == self.growth_interval:
                self.scale = min(self.scale * self.growth_factor, self.max_scale)
                self._clean_steps = 0
                self._overflows_in_a_row = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "overflows_in_a_row": self._overflows_in_a_row,
                "clean_steps": self._clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._overflows_in_a_row = int(state["overflows_in_a_row"])
        self._clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])
