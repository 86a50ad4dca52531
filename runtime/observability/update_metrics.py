"""The metrics of one optimizer update, by torchtitan's names where it has one.

Beside what ``StepRecord`` already holds (loss, lr, grad_norm, loss_scale, tokens_per_s over all
ranks, step_time_s, the exposed waits), each update gets:

- ``throughput(tps)``: tokens per second per device; ``tflops``: model TFLOPS per device
  (``runtime.observability.flops``); ``mfu(%)``: 100 * tflops / the device's peak
  (``runtime.observability.peak_flops``; absent when the peak is unknown). Absent for batches without
  token ids (nothing to count);
- ``time_metrics/end_to_end(s)`` (the step time) split into ``forward(s)``, ``backward(s)``,
  ``optimizer(s)`` and ``other(s)`` (``runtime.observability.phases``), the exposed waits as
  ``time_metrics/exposed_wait_<kind>(s)`` (inside forward and backward, not beside them), the
  plan's prediction as ``time_metrics/predicted_end_to_end(s)``, and what measuring and
  reporting the previous update cost, ``time_metrics/logging(s)``: the CPU time of the thread
  that ran it (``time.thread_time``; waiting for the GIL while the engine's own worker threads
  hold it is their work, not the logger's);
- ``memory/*`` and ``ssd/*`` (``runtime.observability.memory``), with the plan's predicted peaks as
  ``memory/predicted_max_active(GiB)`` and ``memory/predicted_host_peak(GiB)``;
- on several ranks, ``collectives/<kind>`` and ``collectives/<kind>(MiB)``: the all-gathers,
  reduce-scatters, all-reduces and broadcasts the engine issued in the update
  (``runtime.hw.collective_counts``).

Trackers also get the loss as ``loss_metrics/global_avg_loss`` (the mean over ranks and
micro-batches), ``grad_norm``, ``lr`` and ``loss_scale``, which metrics.jsonl keeps under its
original names.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from torch import nn

from protrain.profiler.plan import Plan
from protrain.runtime.activations.manager import ActivationManager
from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.config.settings import TrainingSettings
from protrain.runtime.hw import collective_counts
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.distributed import DistContext
from protrain.runtime.observability.console import StepRecord
from protrain.runtime.observability.flops import model_flops
from protrain.runtime.observability.memory import GIB, MemoryMeter
from protrain.runtime.observability.peak_flops import peak_flops
from protrain.runtime.observability.phases import PhaseClock

MIB = 1 << 20


class MetricSources(Protocol):
    """What the metrics read of the engine (its managers change when it switches plans)."""

    chunks: ChunkManager
    activations: ActivationManager
    dist_ctx: DistContext


class UpdateMetrics:
    """Rank 0's measurements of one engine's updates (see the module docstring)."""

    def __init__(
        self,
        *,
        module: nn.Module,
        device: DeviceInfo,
        settings: TrainingSettings,
        sources: MetricSources,
        log: Callable[[str], None],
        compute_clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``compute_clock``: the host clock the phases are timed on where there are no device
        events (CPU; tests give a fake one)."""
        self.phases = PhaseClock(device, compute_clock)
        self.memory = MemoryMeter(device)
        self._sources = sources
        self.flops = model_flops(module, sources.chunks.layout.params, sources.activations.blocks)
        self.peak = peak_flops(device, settings.precision)
        self._accumulation = settings.gradient_accumulation_steps
        self.logging_s: float | None = None
        """What measuring and reporting the previous update took (``add_logging_time``)."""
        self._own_s = 0.0
        """This update's measuring so far (its start, its forwards' readings)."""
        if self.flops.attention_missing is not None:
            log(f"metrics: {self.flops.attention_missing}")
        if self.peak.tflops is not None or device.is_cuda:
            log(f"metrics: mfu(%) against {self.peak.source}")

    def window_started(self) -> None:
        started = time.thread_time()
        self.phases.start_window()
        self.memory.start_window()
        collective_counts.take(self._sources.dist_ctx.group)  # what came before is not this update's
        self._own_s += time.thread_time() - started

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        with self.phases.forward():
            yield
        started = time.thread_time()
        self.memory.sample()  # activations peak where forward ends
        self._own_s += time.thread_time() - started

    def add_logging_time(self, report_s: float) -> None:
        """Reporting the update took ``report_s``: with this update's measuring, it is the next
        record's ``time_metrics/logging(s)``."""
        self.logging_s, self._own_s = self._own_s + report_s, 0.0

    def collect(self, record: StepRecord, *, plan: Plan, static_device_bytes: int) -> dict[str, float]:
        """The update's metrics (read after the update's synchronisation)."""
        values: dict[str, float] = {}
        step_s, world = record.step_time_s, self._sources.dist_ctx.world_size
        if record.tokens > 0 and step_s > 0:
            values["throughput(tps)"] = record.tokens / step_s / world
            flops = self.flops.per_update(tokens=record.tokens, samples=record.samples)
            tflops = flops / world / step_s / 1e12
            values["tflops"] = tflops
            if self.peak.tflops is not None:
                values["mfu(%)"] = 100.0 * tflops / self.peak.tflops
        values.update(self._times(record, plan))
        store = self._sources.activations.store
        memory = self.memory.take(static_device_bytes=static_device_bytes, ssd=None if store is None else store.stats)
        values.update(memory)
        if plan.predicted_peak_device_bytes is not None:
            values["memory/predicted_max_active(GiB)"] = plan.predicted_peak_device_bytes / GIB
        if plan.predicted_peak_host_bytes is not None:
            values["memory/predicted_host_peak(GiB)"] = plan.predicted_peak_host_bytes / GIB
        if self._sources.dist_ctx.world_size > 1:
            values.update(self._collectives())
        return values

    def _collectives(self) -> dict[str, float]:
        """The update's collectives by kind: calls, and MiB by the collective's definition."""
        issued = collective_counts.take(self._sources.dist_ctx.group)
        values: dict[str, float] = {}
        for kind in collective_counts.KINDS:
            calls, nbytes = issued.get(kind, (0, 0))
            values[f"collectives/{kind}"] = calls
            values[f"collectives/{kind}(MiB)"] = nbytes / MIB
        return values

    def _times(self, record: StepRecord, plan: Plan) -> dict[str, float]:
        phases = self.phases.take()
        times = {
            "time_metrics/end_to_end(s)": record.step_time_s,
            "time_metrics/forward(s)": phases.forward_s,
            "time_metrics/backward(s)": phases.backward_s,
        }
        accounted = phases.forward_s + phases.backward_s
        if phases.optimizer_s is not None:
            times["time_metrics/optimizer(s)"] = phases.optimizer_s
            accounted += phases.optimizer_s
        times["time_metrics/other(s)"] = max(0.0, record.step_time_s - accounted)
        for kind, seconds in record.waits.items():
            times[f"time_metrics/exposed_wait_{kind.removesuffix('_s')}(s)"] = seconds
        if plan.predicted_step_s is not None:
            # The plan predicts one micro-batch's step; a window repeats it (as the plan check).
            times["time_metrics/predicted_end_to_end(s)"] = plan.predicted_step_s * self._accumulation
        if self.logging_s is not None:
            times["time_metrics/logging(s)"] = self.logging_s
        return times

    def close(self) -> None:
        self.memory.close()


def tracker_metrics(record: StepRecord, extra: dict[str, float]) -> dict[str, float]:
    """What the trackers get: the record's training values under torchtitan's names, then ``extra``."""
    values = {"loss_metrics/global_avg_loss": record.loss, "lr": record.lr}
    if record.grad_norm is not None:
        values["grad_norm"] = record.grad_norm
    if record.loss_scale is not None:
        values["loss_scale"] = record.loss_scale
    return {**values, **extra}
