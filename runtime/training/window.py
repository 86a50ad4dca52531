"""One accumulation window's running totals: what the micro-batches of one update add up to
before the engine decides, the same on every rank, whether and how to update."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from protrain.runtime.data.batches import count_samples, count_tokens


@dataclass(slots=True)
class Window:
    """This rank's share of the window; the engine sums the ranks' in one collective."""

    start_s: float | None = None
    """When its first training forward began (None: none yet)."""
    loss: torch.Tensor | None = None
    """The sum of its finite losses (float64, where the losses are: adding one to it reads
    nothing back to the host, whose wait for the device would stall every micro-batch)."""
    nonfinite: torch.Tensor | None = None
    """How many of its losses were not finite (float64, beside ``loss``)."""
    tokens: int = 0
    samples: int = 0
    normalised: bool = False
    """Its losses came normalised over the window by the caller (``backward(scale_wrt_gas=False)``)."""

    def count_batch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.tokens += count_tokens(args, kwargs)
        self.samples += count_samples(args, kwargs)

    def add_loss(self, loss: torch.Tensor) -> None:
        detached = loss.detach().to(torch.float64)
        finite = torch.nan_to_num(detached, nan=0.0, posinf=0.0, neginf=0.0)
        bad = (~torch.isfinite(detached)).to(torch.float64)
        self.loss = finite if self.loss is None else self.loss + finite
        self.nonfinite = bad if self.nonfinite is None else self.nonfinite + bad

    def any_nonfinite(self) -> bool:
        """Whether a loss so far was not finite (reads the device: only where the answer is needed now)."""
        return self.nonfinite is not None and bool(self.nonfinite > 0)

    def totals(self, *, stop: bool) -> torch.Tensor:
        """(loss sum, non-finite losses, tokens, samples, stop flag), to be summed over ranks."""
        loss = 0.0 if self.loss is None else float(self.loss)
        nonfinite = 0.0 if self.nonfinite is None else float(self.nonfinite)
        values = [loss, nonfinite, float(self.tokens), float(self.samples)]
        return torch.tensor([*values, 1.0 if stop else 0.0], dtype=torch.float64)


class AccumulationWindow:
    """Where the engine is in its accumulation window: the micro-batches ``step()`` counted, the
    caller's end-of-window signal, whether the last backward closed the window, and the totals."""

    def __init__(self, accumulation_steps: int) -> None:
        self.accumulation_steps = accumulation_steps
        self.totals = Window()
        self.steps = 0
        """Micro-batches ``step()`` counted in the window in progress."""
        self.boundary: bool | None = None
        """The caller's end-of-window signal (``set_gradient_accumulation_boundary``)."""
        self.backward_closes: bool | None = None
        """Whether the last backward was its window's last (it started the early updates); None
        once its ``step()`` counted it."""

    @property
    def in_progress(self) -> bool:
        return self.steps != 0 or self.backward_closes is not None

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` call will update the parameters: the caller's signal
        when it gave one, else at every gradient_accumulation_steps-th micro-batch."""
        if self.boundary is not None:
            return self.boundary
        return self.steps + 1 >= self.accumulation_steps

    def step_closes(self) -> bool:
        """Count the micro-batch ``step()`` is making; whether it ends the window, as its backward
        was told."""
        closes = self.is_gradient_accumulation_boundary()
        if self.backward_closes is not None and closes != self.backward_closes:
            raise RuntimeError(
                "the accumulation boundary changed between backward and step: call "
                "set_gradient_accumulation_boundary before the micro-batch's backward"
            )
        self.steps += 1
        self.backward_closes = None
        return closes

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """DeepSpeed's end-of-window signal: True, the coming micro-batch ends the window whatever
        its length (a Trainer's last window of an epoch can be short); False, it does not; None,
        count gradient_accumulation_steps again. It holds until changed; set it before the
        micro-batch's backward (the window's last backward starts its early updates)."""
        self.boundary = is_boundary

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do between windows (each update drops its window's gradients), where
        training loops call it; in the middle of a window it raises rather than drop part of it."""
        if self.in_progress:
            raise RuntimeError(
                "zero_grad in the middle of an accumulation window: the engine drops a window's "
                "gradients itself after its update"
            )

    def refuse_open_when_applied_on_arrival(self, closes: bool, applies_on_arrival: bool) -> None:
        """A backward that leaves its window open, where each gradient is applied as it arrives."""
        if applies_on_arrival and not closes:
            raise RuntimeError(
                "this backward does not end its accumulation window, but the engine applies each "
                "gradient as it arrives (gradient_accumulation_steps 1, no clipping, not fp16): set "
                "gradient_accumulation_steps in the spec to the window's length"
            )

    def refuse_inside(self, what: str, advice: str = "") -> None:
        """Raise when a window is in progress: ``what`` must run between windows."""
        if self.steps != 0:
            raise RuntimeError(f"{what} in the middle of an accumulation window{advice}")

    def restart(self) -> Window:
        """A new window begins; the finished one's totals are returned."""
        finished, self.totals = self.totals, Window()
        self.steps, self.backward_closes = 0, None
        return finished
