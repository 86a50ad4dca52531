"""Measured beside predicted: after the first updates, the step time the plan's cost model
predicted is set against the median measured one, printed on rank 0 and written to the
metrics file, so a wrong model (or a machine busier than when it was profiled) shows."""

from __future__ import annotations

import statistics
from typing import Any

from profiler.plan import Plan

CHECK_AFTER_UPDATES = 5
"""Updates measured before the comparison; the first is left out (allocations, caches)."""


class PlanCheck:
    def __init__(self, plan: Plan, *, accumulation: int, after: int = CHECK_AFTER_UPDATES) -> None:
        # The prediction is one micro-batch's forward and backward plus the update; a window of
        # several micro-batches repeats the first part (counting the update once per micro-batch
        # overstates it a little).
        self.predicted_s = None if plan.predicted_step_s is None else plan.predicted_step_s * accumulation
        self.after = after
        self._seconds: list[float] = []
        self.done = self.predicted_s is None

    def observe(self, step_time_s: float) -> dict[str, Any] | None:
        """Note one update's time; returns the comparison (once) when enough are in."""
        if self.done:
            return None
        self._seconds.append(step_time_s)
        if len(self._seconds) < self.after:
            return None
        self.done = True
        assert self.predicted_s is not None
        measured = statistics.median(self._seconds[1:])
        return {
            "event": "plan_check",
            "updates": len(self._seconds),
            "measured_step_s": round(measured, 6),
            "predicted_step_s": round(self.predicted_s, 6),
            "error": round(self.predicted_s / measured - 1.0, 4),
        }


def describe(event: dict[str, Any]) -> str:
    return (
        f"plan check: measured {event['measured_step_s']:.4f} s/step "
        f"(median of updates 2-{event['updates']}), "
        f"predicted {event['predicted_step_s']:.4f} s ({event['error']:+.1%})"
    )
