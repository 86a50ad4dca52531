"""One accumulation window's running totals: what the micro-batches of one update add up to
before the engine decides, the same on every rank, whether and how to update."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.batches import count_samples, count_tokens


def _zero() -> torch.Tensor:
    return torch.zeros((), dtype=torch.float64)


@dataclass(slots=True)
class Window:
    """This rank's share of the window; the engine sums the ranks' in one collective."""

    start_s: float | None = None
    """When its first training forward began (None: none yet)."""
    loss: torch.Tensor = field(default_factory=_zero)
    """The sum of its finite losses (float64, on the host)."""
    nonfinite: torch.Tensor = field(default_factory=_zero)
    """How many of its losses were not finite."""
    tokens: int = 0
    samples: int = 0
    normalised: bool = False
    """Its losses came normalised over the window by the caller (``backward(scale_wrt_gas=False)``)."""

    def count_batch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.tokens += count_tokens(args, kwargs)
        self.samples += count_samples(args, kwargs)

    def add_loss(self, loss: torch.Tensor) -> None:
        detached = loss.detach().to(torch.float64).cpu()
        self.loss += torch.nan_to_num(detached, nan=0.0, posinf=0.0, neginf=0.0)
        self.nonfinite += (~torch.isfinite(detached)).to(torch.float64)

    def totals(self, *, stop: bool) -> torch.Tensor:
        """(loss sum, non-finite losses, tokens, samples, stop flag), to be summed over ranks."""
        values = [float(self.loss), float(self.nonfinite), float(self.tokens), float(self.samples)]
        return torch.tensor([*values, 1.0 if stop else 0.0], dtype=torch.float64)
