"""Dynamic loss scaling for fp16: halve on overflow, double after a run of clean updates."""

from __future__ import annotations

from protrain.runtime.config.settings import LossScaleSettings


class DynamicLossScaler:
    """The scale multiplies the loss before backward; gradients are divided by it before the
    update. Every rank sees the same reduced gradients, so every rank takes the same decision."""

    def __init__(self, settings: LossScaleSettings) -> None:
        self.settings = settings
        self.scale = settings.initial
        self.clean_steps = 0

    def update(self, *, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.settings.min_scale, self.scale / 2.0)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.settings.growth_interval:
            self.scale *= 2.0
            self.clean_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
