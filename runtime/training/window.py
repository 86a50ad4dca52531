"""One accumulation window's running totals: what the micro-batches of one update add up to
before the engine decides, the same on every rank, whether and how to update."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from protrain.runtime.batches import count_samples, count_tokens


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
