"""What the engine tells about each update, and what it checks against the plan.

One ``UpdateReports`` per engine: the progress display (rank 0), ``metrics.jsonl`` with each
update's metrics (``runtime.metrics``: throughput, MFU, the step time's phases, memory) and the
trackers of the spec's ``logging`` section (TensorBoard, W&B; rank 0), and, after a few updates,
the plan check: the measured step time and peak device memory beside the plan's
predictions (``runtime.planning.plan_check``), with its peak-memory probe (hooks on the model
while it measures). A check that finds the plan wrong may hand back another plan (the
``Replanner``'s), which the engine then switches to; that plan is adopted here too (shown and
recorded, its checks started over).
"""

from __future__ import annotations

import contextlib
import time

from torch import nn

from protrain.profiler.plan import Plan
from protrain.runtime.config.settings import TrainingSettings
from protrain.runtime.console import MetricsFile, ProgressReporter, StepRecord
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.distributed import DistContext
from protrain.runtime.metrics.trackers import Trackers, open_trackers
from protrain.runtime.metrics.update_metrics import MetricSources, UpdateMetrics, tracker_metrics
from protrain.runtime.planning.memory_probe import PeakMemoryProbe
from protrain.runtime.planning.plan_check import PlanCheck
from protrain.runtime.planning.plan_check import describe as describe_plan_check
from protrain.runtime.planning.plan_check import judge as judge_plan_check
from protrain.runtime.planning.replanner import Replanner


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
        settings: TrainingSettings,
        static_device_bytes: int,
        replanner: Replanner | None,
        sources: MetricSources,
    ) -> None:
        """``metrics``: rank 0's file (None on the other ranks, which measure nothing more)."""
        self.reporter = reporter
        self.metrics = metrics
        self._module = module
        self._device = device
        self._accumulation = settings.gradient_accumulation_steps
        self._every_steps = settings.logging.every_steps
        self._static_device_bytes = static_device_bytes
        self._replanner = replanner
        self.check = PlanCheck(plan, accumulation=self._accumulation)
        self._probe = PeakMemoryProbe(module, device, static_device_bytes=static_device_bytes)
        self.measured: UpdateMetrics | None = None
        self.trackers = Trackers([], every_steps=settings.logging.every_steps)
        if metrics is not None:
            self.measured = UpdateMetrics(
                module=module,
                device=device,
                settings=settings,
                sources=sources,
                log=reporter.print,
            )
            self.trackers = open_trackers(settings.logging, run_dir=metrics.path.parent, log=reporter.print)

    def window_started(self) -> None:
        """An accumulation window's first forward: the probe watches the peak while the check
        wants it; the phases and memory of the update are measured from here."""
        if self.check.measuring_peak:
            self._probe.start()
        if self.measured is not None:
            self.measured.window_started()

    def forward(self, training: bool) -> contextlib.AbstractContextManager[None]:
        """Around a forward: a training one is timed (its end is where activations peak)."""
        if self.measured is None or not training:
            return contextlib.nullcontext()
        return self.measured.forward()

    def backward_began(self) -> None:
        if self.measured is not None:
            self.measured.phases.begin_backward()

    def backward_ended(self) -> None:
        if self.measured is not None:
            self.measured.phases.end_backward()

    def times_update(self, step: int) -> bool:
        """Whether update ``step``'s time is read, so the device must finish it first: the plan
        check still measures, or the display and trackers log it (update 1 and every
        ``logging.every_steps``). Otherwise the engine does not wait for the device at the
        update's end (its tail then counts in the next update's time; the sum over logged
        updates is the same)."""
        return not self.check.done or step == 1 or step % self._every_steps == 0

    def update_queued(self) -> None:
        """The update's work is issued (the engine synchronises next): the optimizer phase ends."""
        if self.measured is not None:
            self.measured.phases.end_update()

    def report(self, record: StepRecord, *, plan: Plan, dist_ctx: DistContext) -> Plan | None:
        """Show and write ``record``; feed the plan check. A plan the engine must switch to, or
        None (every rank gets the same answer: the replanner agrees it across ranks)."""
        started = time.thread_time()
        self.reporter.update(record)
        compute_s = None
        if self.metrics is not None and self.measured is not None:
            extra = self.measured.collect(record, plan=plan, static_device_bytes=self._static_device_bytes)
            self.metrics.write({**record.to_json(), **extra})
            if self.trackers.due(record.step):
                self.trackers.log(tracker_metrics(record, extra), record.step)
            self.measured.add_logging_time(time.thread_time() - started)
            compute_s = extra["time_metrics/forward(s)"] + extra["time_metrics/backward(s)"]
        check = None if record.skipped else self.check.observe(record.step_time_s, self._probe.stop, compute_s)
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
            self._static_device_bytes = static_device_bytes
            self._probe.stop()
            self._probe = PeakMemoryProbe(self._module, self._device, static_device_bytes=static_device_bytes)
        self.check = PlanCheck(plan, accumulation=self._accumulation)
        if self.measured is not None:
            self.measured.memory.rebase()
        self.reporter.show_plan(plan)
        if self.metrics is not None:
            self.metrics.write({"event": "plan", "plan": plan.to_dict()})

    def stop_probe(self) -> None:
        """Take the probe's hooks off the model (the engine closes)."""
        if self._probe.active:
            self._probe.stop()

    def close(self) -> None:
        with contextlib.ExitStack() as closing:  # last in, first closed; each even if one fails
            if self.metrics is not None:
                closing.callback(self.metrics.close)
            if self.measured is not None:
                closing.callback(self.measured.close)
            closing.callback(self.trackers.close)
            closing.callback(self.reporter.close)
