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

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from protrain.profiler.plan import Plan

CHECK_AFTER_UPDATES = 5
"""Updates measured before the comparison; the first is left out (allocations, caches)."""
STALE_MARGIN = 0.25
"""A measured compute (or step) time off the prediction by more than this fraction is off."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanCheckResult:
    """Measured beside predicted, over updates 2 to ``updates`` (medians); errors are
    ``predicted / measured - 1`` (None where the measured figure is zero)."""

    updates: int
    measured_step_s: float
    predicted_step_s: float
    error: float
    measured_compute_s: float | None = None
    """The forward and backward phases (None: not measured, no metrics on this rank)."""
    predicted_compute_s: float | None = None
    compute_error: float | None = None
    measured_peak_device_bytes: int | None = None
    predicted_peak_device_bytes: int | None = None
    peak_error: float | None = None
    profile: Literal["cached", "measured"] | None = None
    """Where the plan's profiles came from (None: not judged yet)."""
    off: bool = False
    """The compute share (else the step time) is off the prediction by more than ``STALE_MARGIN``."""
    dropped_profiles: tuple[str, ...] = ()
    """Cached profiles dropped because this launch found them off a second time."""
    noted_off: tuple[str, ...] = ()
    """Cached profiles noted off (the next launch that finds them off drops them)."""

    def findings(self) -> dict[str, float]:
        """What a cache entry keeps of a check that found it off."""
        keys = ("measured_compute_s", "predicted_compute_s", "compute_error", "measured_step_s", "error")
        values = {key: getattr(self, key) for key in keys}
        return {key: value for key, value in values.items() if value is not None}

    def to_event(self) -> dict[str, Any]:
        """The metrics file's ``plan_check`` record."""
        event: dict[str, Any] = {
            "event": "plan_check",
            "updates": self.updates,
            "measured_step_s": self.measured_step_s,
            "predicted_step_s": self.predicted_step_s,
            "error": self.error,
        }
        if self.measured_compute_s is not None:
            event["measured_compute_s"] = self.measured_compute_s
            event["predicted_compute_s"] = self.predicted_compute_s
            event["compute_error"] = self.compute_error
        if self.measured_peak_device_bytes is not None:
            event["measured_peak_device_bytes"] = self.measured_peak_device_bytes
            event["predicted_peak_device_bytes"] = self.predicted_peak_device_bytes
            event["peak_error"] = self.peak_error
        if self.profile is not None:
            event["profile"], event["off"] = self.profile, self.off
        if self.dropped_profiles:
            event["dropped_profiles"] = list(self.dropped_profiles)
        if self.noted_off:
            event["noted_off"] = list(self.noted_off)
        return event


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
    ) -> PlanCheckResult | None:
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
        compute: dict[str, Any] = {}
        if self.predicted_compute_s is not None and len(self._compute) == len(self._seconds):
            median = statistics.median(self._compute[1:])
            compute = {
                "measured_compute_s": round(median, 6),
                "predicted_compute_s": round(self.predicted_compute_s, 6),
                "compute_error": _error(self.predicted_compute_s, median),
            }
        peak: dict[str, Any] = {}
        if peak_bytes is not None and self.predicted_peak_bytes is not None:
            highest = peak_bytes()
            peak = {
                "measured_peak_device_bytes": highest,
                "predicted_peak_device_bytes": self.predicted_peak_bytes,
                "peak_error": _error(self.predicted_peak_bytes, highest),
            }
        return PlanCheckResult(
            updates=len(self._seconds),
            measured_step_s=round(measured, 6),
            predicted_step_s=round(self.predicted_s, 6),
            error=round(self.predicted_s / measured - 1.0, 4),
            **compute,
            **peak,
        )


def _error(predicted: float, measured: float) -> float | None:
    return round(predicted / measured - 1.0, 4) if measured > 0 else None


def judge(result: PlanCheckResult, *, from_cache: bool) -> PlanCheckResult:
    """``result`` with where its profiles came from and whether the prediction is off by more
    than ``STALE_MARGIN``: the compute share's when it was measured, else the step time's."""
    error = result.error if result.compute_error is None else result.compute_error
    profile: Literal["cached", "measured"] = "cached" if from_cache else "measured"
    return dataclasses.replace(result, profile=profile, off=abs(error) > STALE_MARGIN)


def describe(result: PlanCheckResult) -> str:
    """The comparison in words, and on a second line what an off prediction means."""
    error = result.error
    text = (
        f"plan check: measured {result.measured_step_s:.4f} s/step "
        f"(median of updates 2-{result.updates}), predicted {result.predicted_step_s:.4f} s "
        f"(prediction {abs(error):.1%} {'above' if error >= 0 else 'below'} the measured)"
    )
    if result.compute_error is not None:
        text += (
            f"; forward and backward {result.measured_compute_s:.4f} s, predicted "
            f"{result.predicted_compute_s:.4f} s ({result.compute_error:+.1%})"
        )
    if result.measured_peak_device_bytes is not None and result.predicted_peak_device_bytes is not None:
        peak_error = result.peak_error
        text += (
            f"; peak device memory measured {result.measured_peak_device_bytes / 2**20:.1f} MiB, "
            f"predicted {result.predicted_peak_device_bytes / 2**20:.1f} MiB"
            + (f" ({peak_error:+.1%})" if peak_error is not None else "")
        )
    verdict = _verdict(result)
    return text if verdict is None else f"{text}\nplan check: {verdict}"


def _verdict(result: PlanCheckResult) -> str | None:
    """What an off prediction means and what was done about it (None when it is not off)."""
    if not result.off:
        return None
    what = "the step time" if result.compute_error is None else "the forward and backward time"
    off = f"{what} is off the prediction by more than {STALE_MARGIN:.0%}"
    if result.profile != "cached":
        return f"{off} although the profile was measured in this run: the cost model misjudges this run"
    if result.dropped_profiles:
        done = "the previous launch found it off too: dropped it from the cache, so the next launch profiles again"
    elif result.noted_off:
        done = (
            "noted in the cache: if the next launch finds it off too, it is dropped and measured again "
            "(PROTRAIN_REFRESH_PROFILE=1 measures now)"
        )
    else:
        done = "remove it from profiler.cache_dir, or launch with PROTRAIN_REFRESH_PROFILE=1, to profile again"
    return f"{off}: the cached profile looks stale (measured at a busier or quieter moment than now); {done}"
