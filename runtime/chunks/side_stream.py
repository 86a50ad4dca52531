"""The one ordered queue that issues every collective of the chunk engine.

Transfers: one side stream (a worker thread on CPU) issues every collective in program order,
so all ranks pair them up: gathers ahead of use (prefetch, residency.py), the agreement on a
non-finite loss and reduce-scatters during backward (reduce.py). The main thread only issues
collectives after draining it. With offloaded chunks every rank must therefore run the same
modules in a step (as with any ZeRO-3 implementation).
"""

from __future__ import annotations

from collections.abc import Callable

from protrain.runtime.chunks.waits import ExposedWaits
from protrain.runtime.hw.device import DeviceEvent, DeviceInfo, SideStream


class CollectiveQueue:
    """Work for the side stream, in submission order, and the wait for all of it."""

    def __init__(self, device: DeviceInfo) -> None:
        self.stream = SideStream(device, name="protrain-chunks")
        """The one thread (CUDA: stream) that issues every collective, in program order."""
        self._last_submitted: DeviceEvent | None = None
        self.waits = ExposedWaits()
        """Where the main thread waited for the pipeline (waits.py): the engine takes them per step."""

    def submit(self, work: Callable[[], None]) -> DeviceEvent:
        self._last_submitted = self.stream.submit(work)
        return self._last_submitted

    def make_compute_wait(self, event: DeviceEvent) -> None:
        """Compute waits for a gather (counted as an exposed transfer wait)."""
        with self.waits.timing("transfer"):
            self.stream.make_compute_wait(event)

    def drain(self) -> None:
        """Wait for everything queued on the side stream (it runs in order, so the last event
        suffices). Collectives from the main thread may only follow a drain: every rank must
        issue its collectives in one order."""
        if self._last_submitted is not None:
            self._last_submitted.wait()
            self._last_submitted = None

    def close(self) -> None:
        self.stream.close()
