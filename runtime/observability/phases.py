"""One update's step time split into forward, backward and optimizer, on the compute clock.

- forward: the window's training forwards, summed;
- backward: its backward calls, summed (with the reductions each flushes as it ends);
- optimizer: from the last backward's end to the update's end (the window's totals, clipping,
  whatever CPU Adam did not hide behind backward, the refreshed device copies);
- other: the rest of the step time (the script between micro-batches: data loading, logging).

On CUDA the marks are timing events recorded on the compute stream (``torch.cuda`` used here
rather than through the device layer: nothing else reads them), read after the update's
synchronisation, when every one has completed: measuring never makes the host wait for the
device, and a phase is the device's time from its start to its end, idle gaps inside it
included. On CPU compute runs on the calling thread, so the marks are the host clock.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from protrain.runtime.hw.device import DeviceInfo


class TimeMark:
    """A point on the compute stream's timeline."""

    __slots__ = ("_event", "_host_s")

    def __init__(self, cuda: bool, host_clock: Callable[[], float] = time.perf_counter) -> None:
        self._event: torch.cuda.Event | None = None
        self._host_s = 0.0
        if cuda:
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record()
        else:
            self._host_s = host_clock()

    def seconds_to(self, later: TimeMark) -> float:
        """Seconds from this mark to ``later`` (on CUDA both must have completed)."""
        if self._event is not None and later._event is not None:
            return self._event.elapsed_time(later._event) / 1000.0
        return later._host_s - self._host_s


@dataclass(frozen=True, slots=True)
class PhaseTimes:
    forward_s: float
    backward_s: float
    optimizer_s: float | None
    """None: the update had no backward (nothing to time it from)."""


class PhaseClock:
    """The marks of one accumulation window (see the module docstring)."""

    def __init__(self, device: DeviceInfo, host_clock: Callable[[], float] = time.perf_counter) -> None:
        """``host_clock``: what marks read where compute runs on the host (tests give a fake one)."""
        self._cuda = device.is_cuda
        self._host_clock = host_clock
        self._forwards: list[tuple[TimeMark, TimeMark]] = []
        self._backwards: list[tuple[TimeMark, TimeMark]] = []
        self._backward_start: TimeMark | None = None
        self._update_end: TimeMark | None = None

    def _mark(self) -> TimeMark:
        return TimeMark(self._cuda, self._host_clock)

    def start_window(self) -> None:
        self._forwards.clear()
        self._backwards.clear()
        self._backward_start = self._update_end = None

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        start = self._mark()
        yield
        self._forwards.append((start, self._mark()))

    def begin_backward(self) -> None:
        self._backward_start = self._mark()

    def end_backward(self) -> None:
        if self._backward_start is not None:
            self._backwards.append((self._backward_start, self._mark()))
            self._backward_start = None

    def end_update(self) -> None:
        """The update's device work is queued (the engine synchronises next)."""
        self._update_end = self._mark()

    def take(self) -> PhaseTimes:
        """The window's times; call after the update's synchronisation. The marks are dropped."""
        optimizer_s = None
        if self._backwards and self._update_end is not None:
            optimizer_s = self._backwards[-1][1].seconds_to(self._update_end)
        times = PhaseTimes(
            forward_s=sum(start.seconds_to(end) for start, end in self._forwards),
            backward_s=sum(start.seconds_to(end) for start, end in self._backwards),
            optimizer_s=optimizer_s,
        )
        self.start_window()
        return times
