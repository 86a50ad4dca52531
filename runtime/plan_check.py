"""Measured beside predicted: after the first updates, the step time the plan's cost model
predicted is set against the median measured one, and the predicted peak device memory against
the peak measured over the same updates (``runtime.memory_probe``), printed on rank 0 and written
to the metrics file, so a wrong model (or a machine busier than when it was profiled) shows."""

from __future__ import annotations

import statistics
from collections.abc import Callable
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
        self.predicted_peak_bytes = plan.predicted_peak_device_bytes
        self.after = after
        self._seconds: list[float] = []
        self.done = self.predicted_s is None

    @property
    def measuring_peak(self) -> bool:
        """Whether the coming update is one the peak is measured over (all but the first)."""
        return not self.done and len(self._seconds) >= 1

    def observe(
        self, step_time_s: float, peak_bytes: Callable[[], int] | None = None
    ) -> dict[str, Any] | None:
        """Note one update's time; returns the comparison (once) when enough are in, with the
        measured peak from ``peak_bytes()`` (called then) when given."""
        if self.done:
            return None
        self._seconds.append(step_time_s)
        if len(self._seconds) < self.after:
            return None
        self.done = True
        assert self.predicted_s is not None
        measured = statistics.median(self._seconds[1:])
        event: dict[str, Any] = {
            "event": "plan_check",
            "updates": len(self._seconds),
            "measured_step_s": round(measured, 6),
            "predicted_step_s": round(self.predicted_s, 6),
            "error": round(self.predicted_s / measured - 1.0, 4),
        }
        if peak_bytes is not None and self.predicted_peak_bytes is not None:
            peak = peak_bytes()
            event["measured_peak_device_bytes"] = peak
            event["predicted_peak_device_bytes"] = self.predicted_peak_bytes
            event["peak_error"] = round(self.predicted_peak_bytes / peak - 1.0, 4) if peak > 0 else None
        return event


def describe(event: dict[str, Any]) -> str:
    text = (
        f"plan check: measured {event['measured_step_s']:.4f} s/step "
        f"(median of updates 2-{event['updates']}), "
        f"predicted {event['predicted_step_s']:.4f} s ({event['error']:+.1%})"
    )
    if event.get("measured_peak_device_bytes") is not None:
        error = event.get("peak_error")
        text += (
            f"; peak device memory measured {event['measured_peak_device_bytes'] / 2**20:.1f} MiB, "
            f"predicted {event['predicted_peak_device_bytes'] / 2**20:.1f} MiB"
            + (f" ({error:+.1%})" if error is not None else "")
        )
    return text
