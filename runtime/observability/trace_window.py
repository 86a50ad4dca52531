"""``logging.trace: {start_step, steps}``: what the engine records around a few updates.

- Updates ``start_step .. start_step + steps - 1`` run under torch's profiler on every thread
  (``runtime.observability.profiling``), written as ``trace-rank{R}.json.gz`` in the run folder when
  the last of them ends. The profiler starts at the end of the update before the window (at the
  first forward when the window starts at update 1), so its start-up cost lands outside it.
- The update right after the window (``start_step + steps``) records the memory timeline
  (``runtime.observability.memory_timeline``) into ``memory-timeline-rank{R}.json``. Not inside the
  window: on CPU the device tier is the C heap, where the profiler keeps its own event buffers,
  and the profiler's overhead would stretch the time axis; next to it the pipeline is in the
  same steady state the trace shows. A run that ends before that update records none (it says so).

Update numbers count every window, skipped ones too, as ``metrics.jsonl``'s ``step`` does. With
the setting off the engine holds ``NO_TRACE``, whose calls do nothing. A failure to write is
reported and training goes on: observing must never end a run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from protrain.runtime.config.settings import TraceSettings
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.distributed import DistContext, broadcast_object
from protrain.runtime.observability.console import MetricsFile
from protrain.runtime.observability.memory_timeline import MemoryTimeline
from protrain.runtime.observability.observer import ObservedEngine, UpdateObserver
from protrain.runtime.observability.profiling import ThreadTrace
from protrain.runtime.observability.timeline_file import timeline_path, trace_path, write_timeline


class NoTrace(UpdateObserver):
    """``logging.trace`` off: every hook does nothing."""


NO_TRACE = NoTrace()


class TraceWindow(UpdateObserver):
    """The trace and the memory timeline of one engine (see the module docstring)."""

    def __init__(
        self,
        settings: TraceSettings,
        *,
        run_dir: Path,
        rank: int,
        cuda: bool,
        log: Callable[[str], None],
        every_thread: bool | None = None,
    ) -> None:
        """``every_thread``: see ``ThreadTrace`` (None: torch's own where it can)."""
        self.first = settings.start_step
        self.last = settings.start_step + settings.steps - 1
        self.timeline_update = self.last + 1
        self.trace_file = trace_path(run_dir, rank)
        self.timeline_file = timeline_path(run_dir, rank)
        self._rank = rank
        self._cuda = cuda
        self._every_thread = every_thread
        self._log = log
        self._trace: ThreadTrace | None = None
        self._trace_done = False
        self._timeline: MemoryTimeline | None = None
        self._timeline_done = False

    @property
    def instrumented(self) -> tuple[int, ...]:
        return (*range(self.first, self.last + 1), self.timeline_update)

    def window_started(self, engine: ObservedEngine) -> None:
        update = engine.global_step + engine.skipped_steps + 1
        if update == self.first:
            self._start_trace()
        if update == self.timeline_update and not self._timeline_done:
            if self._timeline is not None:
                self._timeline.close()  # the window was abandoned (a failed backward) and starts over
            self._timeline = MemoryTimeline(
                module=engine.module,
                chunks=engine.chunks,
                activations=engine.activations,
                device=engine.device_info,
                update=update,
                rank=self._rank,
            )

    def reads_update_time(self, step: int) -> bool:
        """The trace's updates end synchronized (a trace's time axis is the device's)."""
        return True

    def window_finished(self, engine: ObservedEngine) -> None:
        update = engine.global_step + engine.skipped_steps
        if self._trace is not None and update >= self.last:
            self._finish_trace()
        if self._timeline is not None and update >= self.timeline_update:
            timeline, self._timeline = self._timeline, None
            self._timeline_done = True
            try:
                write_timeline(
                    self.timeline_file, timeline.finish(predicted=engine.plan, instrumented=self.instrumented)
                )
            except Exception as err:  # noqa: BLE001 - observing must never end a run
                timeline.close()
                self._log(f"memory timeline not written ({type(err).__name__}: {err}); training goes on")
                return
            self._log(f"memory timeline of update {update}: {self.timeline_file} (protrain-run --plot draws it)")
        if update == self.first - 1:
            self._start_trace()  # before the window's first forward: the profiler's start-up stays outside

    def _start_trace(self) -> None:
        if self._trace is not None or self._trace_done:
            return
        trace = ThreadTrace(cuda=self._cuda, every_thread=self._every_thread)
        try:
            trace.start()
        except RuntimeError as err:  # another profiler (the script's own, another engine's) is running
            self._trace_done = True
            self._log(f"trace of updates {self.first}-{self.last} not taken: {err}")
            return
        self._trace = trace

    def _finish_trace(self, note: str = "") -> None:
        trace, self._trace = self._trace, None
        self._trace_done = True
        if trace is None:
            return
        started = time.perf_counter()
        try:
            trace.stop()
            events = trace.export(self.trace_file)
        except Exception as err:  # noqa: BLE001 - observing must never end a run
            self._log(f"trace not written ({type(err).__name__}: {err}); training goes on")
            return
        how = "" if trace.every_thread else "; worker threads' labels timed by protrain (torch < 2.7)"
        self._log(
            f"trace of updates {self.first}-{self.last}{note}: {self.trace_file} ({events:,} events{how}; "
            f"written in {time.perf_counter() - started:.1f} s, outside every update's step time)"
        )

    def close(self) -> None:
        """The engine closes: a trace still running is written (the run ended inside the
        window); a timeline not finished is dropped. Says what was not recorded."""
        if self._trace is not None:
            self._finish_trace(note=" (the run ended inside the window)")
        elif not self._trace_done:
            self._log(f"no trace: the run ended before update {self.first} (logging.trace.start_step)")
        if self._timeline is not None:
            self._timeline.close()
            self._timeline = None
            self._log(f"no memory timeline: the run ended during update {self.timeline_update}")
        elif not self._timeline_done and self._trace_done:
            self._log(
                f"no memory timeline: the run ended before update {self.timeline_update} "
                "(it is recorded on the update after the trace window)"
            )
        self._timeline_done = self._trace_done = True


def trace_window_for(
    settings: TraceSettings | None,
    run_dir: Path | None,
    metrics: MetricsFile | None,
    dist_ctx: DistContext,
    device: DeviceInfo,
    log: Callable[[str], None],
) -> UpdateObserver:
    """The engine's observer for ``logging.trace``. The run folder: ``run_dir`` where
    protrain-run named it, else the one rank 0 made for ``metrics``; every rank takes rank 0's
    (a collective: every rank has the same spec, so all of them call it or none)."""
    if settings is None:
        return NO_TRACE
    if run_dir is None and metrics is not None:
        run_dir = metrics.path.parent
    folder = broadcast_object(None if run_dir is None else str(run_dir), dist_ctx)
    if folder is None:
        raise RuntimeError("logging.trace needs a run folder, and rank 0 has none")
    return TraceWindow(settings, run_dir=Path(str(folder)), rank=dist_ctx.rank, cuda=device.is_cuda, log=log)
