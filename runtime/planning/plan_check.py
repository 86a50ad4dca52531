"""Measured beside predicted: after the first updates, the step time the plan's cost model
predicted is set against the median measured one, and the predicted peak device memory against
the peak measured over the same updates (``runtime.planning.memory_probe``: the profile's counter
read at the profile's hooks, ``runtime.hw.memory_counter``), printed on rank 0 and written to the
metrics file, so a wrong model (or a machine busier than when it was profiled) shows.

The verdict compares like with like: the compute share of the step (the forward and backward
phases, measured on the compute clock, against the plan's ``predicted_compute_s``), which the
profile's measurements decide, not the whole step, which a busy host moves (CPU Adam and the update
run on its cores). Compute off the prediction by more than ``STALE_MARGIN`` is named: when the
profiles came from the cache they may have been measured at a busier (or quieter) moment than
now: the first launch to find them off notes it in the cache entries, the next that finds them
off too drops them, so the launch after profiles again (replanner.py, profile_cache.py); when they
were measured in this run, the cost model itself is off. Without phase times (no metrics), the
step time is compared instead."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from protrain.profiler.plan import Plan

CHECK_AFTER_UPDATES = 5
"""Updates measured before the comparison; the first is left out (allocations, caches)."""
STALE_MARGIN = 0.25
"""A measured compute (or step) time off the prediction by more than this fraction is off."""
FINDING_KEYS = ("measured_compute_s", "predicted_compute_s", "compute_error", "measured_step_s", "error")
"""What a cache entry keeps of the check that found it off."""


class PlanCheck:
    def __init__(self, plan: Plan, *, accumulation: int, after: int = CHECK_AFTER_UPDATES) -> None:
        # The prediction is one micro-batch's forward and backward plus the update; a window of
        # several micro-batches repeats the first part (counting the update once per micro-batch
        # overstates it a little).
        self.predicted_s = None if plan.predicted_step_s is None else plan.predicted_step_s * accumulation
        self.predicted_compute_s = None if plan.predicted_compute_s is None else plan.predicted_compute_s * accumulation
        self.predicted_peak_bytes = plan.predicted_peak_device_bytes
        self.after = after
        self._seconds: list[float] = []
        self._compute: list[float] = []
        self.done = self.predicted_s is None

    @property
    def measuring_peak(self) -> bool:
        """Whether the coming update is one the peak is measured over (all but the first)."""
        return not self.done and len(self._seconds) >= 1

    def observe(
        self, step_time_s: float, peak_bytes: Callable[[], int] | None = None, compute_s: float | None = None
    ) -> dict[str, Any] | None:
        """Note one update's time (and ``compute_s``, its forward and backward phases, when
        measured); returns the comparison (once) when enough are in, with the measured peak from
        ``peak_bytes()`` (called then) when given."""
        if self.done:
            return None
        self._seconds.append(step_time_s)
        if compute_s is not None:
            self._compute.append(compute_s)
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
        if self.predicted_compute_s is not None and len(self._compute) == len(self._seconds):
            compute = statistics.median(self._compute[1:])
            event["measured_compute_s"] = round(compute, 6)
            event["predicted_compute_s"] = round(self.predicted_compute_s, 6)
            event["compute_error"] = round(self.predicted_compute_s / compute - 1.0, 4) if compute > 0 else None
        if peak_bytes is not None and self.predicted_peak_bytes is not None:
            peak = peak_bytes()
            event["measured_peak_device_bytes"] = peak
            event["predicted_peak_device_bytes"] = self.predicted_peak_bytes
            event["peak_error"] = round(self.predicted_peak_bytes / peak - 1.0, 4) if peak > 0 else None
        return event


def judge(event: dict[str, Any], *, from_cache: bool) -> dict[str, Any]:
    """``event`` with where its profiles came from (``profile``: "cached" or "measured") and
    whether the prediction is off by more than ``STALE_MARGIN`` (``off``): the compute share's
    when it was measured, else the step time's."""
    error = event.get("compute_error")
    off = abs(event["error"] if error is None else error) > STALE_MARGIN
    return {**event, "profile": "cached" if from_cache else "measured", "off": off}


def describe(event: dict[str, Any]) -> str:
    """The comparison in words, and on a second line what an off prediction means."""
    error = event["error"]
    text = (
        f"plan check: measured {event['measured_step_s']:.4f} s/step "
        f"(median of updates 2-{event['updates']}), predicted {event['predicted_step_s']:.4f} s "
        f"(prediction {abs(error):.1%} {'above' if error >= 0 else 'below'} the measured)"
    )
    if event.get("compute_error") is not None:
        text += (
            f"; forward and backward {event['measured_compute_s']:.4f} s, predicted "
            f"{event['predicted_compute_s']:.4f} s ({event['compute_error']:+.1%})"
        )
    if event.get("measured_peak_device_bytes") is not None:
        error = event.get("peak_error")
        text += (
            f"; peak device memory measured {event['measured_peak_device_bytes'] / 2**20:.1f} MiB, "
            f"predicted {event['predicted_peak_device_bytes'] / 2**20:.1f} MiB"
            + (f" ({error:+.1%})" if error is not None else "")
        )
    verdict = _verdict(event)
    return text if verdict is None else f"{text}\nplan check: {verdict}"


def _verdict(event: dict[str, Any]) -> str | None:
    """What an off prediction means and what was done about it (None when it is not off)."""
    if not event.get("off"):
        return None
    what = "the step time" if event.get("compute_error") is None else "the forward and backward time"
    off = f"{what} is off the prediction by more than {STALE_MARGIN:.0%}"
    if event.get("profile") != "cached":
        return f"{off} although the profile was measured in this run: the cost model misjudges this run"
    if event.get("dropped_profiles"):
        done = "the previous launch found it off too: dropped it from the cache, so the next launch profiles again"
    elif event.get("noted_off"):
        done = (
            "noted in the cache: if the next launch finds it off too, it is dropped and measured again "
            "(PROTRAIN_REFRESH_PROFILE=1 measures now)"
        )
    else:
        done = "remove it from profiler.cache_dir, or launch with PROTRAIN_REFRESH_PROFILE=1, to profile again"
    return f"{off}: the cached profile looks stale (measured at a busier or quieter moment than now); {done}"
