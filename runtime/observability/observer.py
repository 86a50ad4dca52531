"""The one interface the Engine calls as it trains, for everything that watches it: the reports
(console, metrics file, trackers: reporting.py) and the trace window (trace_window.py). Each
hook does nothing unless an observer overrides it (as a Trainer's callbacks), and the Engine
calls them all through ``Observers`` at the same moments, so a new kind of observer is one
class, not another call in the Engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

from torch import nn

from protrain.profiler.plan import Plan
from protrain.runtime.activations.manager import ActivationManager
from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.observability.console import StepRecord


class ObservedEngine(Protocol):
    """What observers read of the engine (at each call: a plan switch replaces the managers)."""

    module: nn.Module
    device_info: DeviceInfo

    @property
    def plan(self) -> Plan: ...

    @property
    def chunks(self) -> ChunkManager: ...

    @property
    def activations(self) -> ActivationManager: ...

    @property
    def global_step(self) -> int: ...

    @property
    def skipped_steps(self) -> int: ...


class UpdateObserver:
    """Hooks at the moments of one accumulation window, in the order the Engine reaches them."""

    def window_started(self, engine: ObservedEngine) -> None:
        """The window's first training forward is about to run."""

    def forward(self, training: bool) -> contextlib.AbstractContextManager[None]:
        """Around each forward (``training``: one that trains)."""
        return contextlib.nullcontext()

    def backward_began(self) -> None:
        """A backward is about to run."""

    def backward_ended(self) -> None:
        """It ran (its reductions flushed)."""

    def update_queued(self) -> None:
        """The update's work is issued; the engine may wait for the device next."""

    def reads_update_time(self, step: int) -> bool:
        """Whether update ``step``'s time is read here, so the device must finish it first."""
        return False

    def window_finished(self, engine: ObservedEngine) -> None:
        """The window's update is done (the device synchronized where a time is read)."""

    def update_reported(self, record: StepRecord, plan: Plan) -> None:
        """The update's record, as the user sees it."""

    def close(self) -> None:
        """The engine closes."""


class Observers(UpdateObserver):
    """Every observer of one engine, called in order."""

    def __init__(self, observers: Sequence[UpdateObserver]) -> None:
        self.observers = tuple(observers)

    def window_started(self, engine: ObservedEngine) -> None:
        for observer in self.observers:
            observer.window_started(engine)

    @contextlib.contextmanager
    def forward(self, training: bool) -> Iterator[None]:
        with contextlib.ExitStack() as around:
            for observer in self.observers:
                around.enter_context(observer.forward(training))
            yield

    def backward_began(self) -> None:
        for observer in self.observers:
            observer.backward_began()

    def backward_ended(self) -> None:
        for observer in self.observers:
            observer.backward_ended()

    def update_queued(self) -> None:
        for observer in self.observers:
            observer.update_queued()

    def reads_update_time(self, step: int) -> bool:
        return any(observer.reads_update_time(step) for observer in self.observers)

    def window_finished(self, engine: ObservedEngine) -> None:
        for observer in self.observers:
            observer.window_finished(engine)

    def update_reported(self, record: StepRecord, plan: Plan) -> None:
        for observer in self.observers:
            observer.update_reported(record, plan)
