"""What the engine tells about each update and each plan.

One ``UpdateReports`` per engine: the progress display (rank 0), ``metrics.jsonl`` with each
update's metrics (``runtime.observability``: throughput, MFU, the step time's phases, memory), the
trackers of the spec's ``logging`` section (TensorBoard, W&B; rank 0), and the plans and plan
checks its PlanController (runtime/planning/controller.py) shows: this module only displays and
records, it decides nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from torch import nn

from protrain.profiler.plan import Plan
from protrain.runtime.config.settings import TrainingSettings
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.observability.console import MetricsFile, ProgressReporter, StepRecord
from protrain.runtime.observability.observer import ObservedEngine, UpdateObserver
from protrain.runtime.observability.trackers import Trackers, open_trackers
from protrain.runtime.observability.update_metrics import MetricSources, UpdateMetrics, tracker_metrics
from protrain.runtime.planning.plan_check import PlanCheckResult, describe


class UpdateReports(UpdateObserver):
    """The display, the metrics file and the trackers of one engine (see the module docstring)."""

    def __init__(
        self,
        *,
        module: nn.Module,
        device: DeviceInfo,
        reporter: ProgressReporter,
        metrics: MetricsFile | None,
        settings: TrainingSettings,
        sources: MetricSources,
        compute_clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``metrics``: rank 0's file (None on the other ranks, which measure nothing more);
        ``compute_clock``: the phases' host clock (``UpdateMetrics``)."""
        self.reporter = reporter
        self.metrics = metrics
        self._sources = sources
        self._every_steps = settings.logging.every_steps
        self._static_device_bytes = sources.chunks.device_state_bytes()
        self.measured: UpdateMetrics | None = None
        self.compute_s: float | None = None
        """The last reported update's forward and backward seconds (rank 0; None elsewhere)."""
        self.trackers = Trackers([], every_steps=settings.logging.every_steps)
        if metrics is not None:
            self.measured = UpdateMetrics(
                module=module,
                device=device,
                settings=settings,
                sources=sources,
                log=reporter.print,
                compute_clock=compute_clock,
            )
            self.trackers = open_trackers(settings.logging, run_dir=metrics.path.parent, log=reporter.print)

    def window_started(self, engine: ObservedEngine) -> None:
        """An accumulation window's first forward: the phases and memory of the update are
        measured from here."""
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

    def reads_update_time(self, step: int) -> bool:
        """Whether the display and trackers log update ``step`` (update 1 and every
        ``logging.every_steps``): its time must be read, so the device must finish it first."""
        return step == 1 or step % self._every_steps == 0

    def update_queued(self) -> None:
        """The update's work is issued (the engine synchronises next): the optimizer phase ends."""
        if self.measured is not None:
            self.measured.phases.end_update()

    def update_reported(self, record: StepRecord, plan: Plan) -> None:
        """Show and write ``record``; its forward and backward phases' seconds, where measured
        (rank 0), become ``compute_s``."""
        started = time.thread_time()
        self.reporter.update(record)
        self.compute_s = None
        if self.metrics is None or self.measured is None:
            return
        extra = self.measured.collect(record, plan=plan, static_device_bytes=self._static_device_bytes)
        self.metrics.write({**record.to_json(), **extra})
        if self.trackers.due(record.step):
            self.trackers.log(tracker_metrics(record, extra), record.step)
        self.measured.add_logging_time(time.thread_time() - started)
        self.compute_s = extra["time_metrics/forward(s)"] + extra["time_metrics/backward(s)"]

    def show_plan(self, plan: Plan, *, rebuilt: bool) -> None:
        """``plan`` is in force (``rebuilt``: with new managers, whose static device bytes the
        memory figures count from now): shown and recorded, its memory measured afresh."""
        if rebuilt:
            self._static_device_bytes = self._sources.chunks.device_state_bytes()
        if self.measured is not None:
            self.measured.memory.rebase()
        self.reporter.show_plan(plan)
        if self.metrics is not None:
            self.metrics.write({"event": "plan", "plan": plan.to_dict()})

    def show_deferred_plan(self, plan: Plan) -> None:
        self.reporter.show_deferred_plan(plan)

    def show_check(self, result: PlanCheckResult) -> None:
        self.reporter.print(describe(result))
        if self.metrics is not None:
            self.metrics.write(result.to_event())

    def close(self) -> None:
        with contextlib.ExitStack() as closing:  # last in, first closed; each even if one fails
            if self.metrics is not None:
                closing.callback(self.metrics.close)
            if self.measured is not None:
                closing.callback(self.measured.close)
            closing.callback(self.trackers.close)
            closing.callback(self.reporter.close)
