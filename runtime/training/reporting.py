"""What the engine tells about each update, and what it checks against the plan.

One ``UpdateReports`` per engine: the progress display (rank 0), ``metrics.jsonl`` and, after
a few updates, the plan check: the measured step time and peak device memory beside the plan's
predictions (``runtime.planning.plan_check``), with its peak-memory probe (hooks on the model
while it measures). A check that finds the plan wrong may hand back another plan (the
``Replanner``'s), which the engine then switches to; that plan is adopted here too (shown and
recorded, its checks started over).
"""

from __future__ import annotations

from torch import nn

from profiler.plan import Plan
from runtime.console import MetricsFile, ProgressReporter, StepRecord
from runtime.device import DeviceInfo
from runtime.distributed import DistContext
from runtime.planning.memory_probe import PeakMemoryProbe
from runtime.planning.plan_check import PlanCheck
from runtime.planning.plan_check import describe as describe_plan_check
from runtime.planning.plan_check import judge as judge_plan_check
from runtime.planning.replanner import Replanner


class UpdateReports:
    """The display, the metrics file and the plan check of one engine (see the module docstring)."""

    def __init__(
        self,
        *,
        module: nn.Module,
        device: DeviceInfo,
        reporter: ProgressReporter,
        metrics: MetricsFile | None,
        plan: Plan,
        accumulation: int,
        static_device_bytes: int,
        replanner: Replanner | None,
    ) -> None:
        self.reporter = reporter
        self.metrics = metrics
        self._module = module
        self._device = device
        self._accumulation = accumulation
        self._replanner = replanner
        self.check = PlanCheck(plan, accumulation=accumulation)
        self._probe = PeakMemoryProbe(module, device, static_device_bytes=static_device_bytes)

    def window_started(self) -> None:
        """An accumulation window's first forward: the probe watches the peak while the check
        wants it."""
        if self.check.measuring_peak:
            self._probe.start()

    def report(self, record: StepRecord, *, plan: Plan, dist_ctx: DistContext) -> Plan | None:
        """Show and write ``record``; feed the plan check. A plan the engine must switch to, or
        None (every rank gets the same answer: the replanner agrees it across ranks)."""
        self.reporter.update(record)
        if self.metrics is not None:
            self.metrics.write(record.to_json())
        check = None if record.skipped else self.check.observe(record.step_time_s, self._probe.stop)
        if check is None:
            return None
        # Stale cached profiles are dropped (only a plan from a Replanner's profiles has any).
        replanner = self._replanner
        check = judge_plan_check(check, from_cache=False) if replanner is None else replanner.judge(check)
        self.reporter.print(describe_plan_check(check))
        if self.metrics is not None:
            self.metrics.write(check)
        return None if replanner is None else replanner.after_window(plan, check, dist_ctx)

    def adopt(self, plan: Plan, *, static_device_bytes: int | None = None) -> None:
        """``plan`` is in force: its checks start over; it is shown and recorded.
        ``static_device_bytes``: the new chunk layout's, when the managers were rebuilt (the
        probe's hooks and window go with the old plan)."""
        if static_device_bytes is not None:
            self._probe.stop()
            self._probe = PeakMemoryProbe(self._module, self._device, static_device_bytes=static_device_bytes)
        self.check = PlanCheck(plan, accumulation=self._accumulation)
        self.reporter.show_plan(plan)
        if self.metrics is not None:
            self.metrics.write({"event": "plan", "plan": plan.to_dict()})

    def stop_probe(self) -> None:
        """Take the probe's hooks off the model (the engine closes)."""
        if self._probe.active:
            self._probe.stop()

    def close(self) -> None:
        try:
            self.reporter.close()
        finally:
            if self.metrics is not None:
                self.metrics.close()
