"""Bounded rings of host staging buffers between the device and host shards.

Copies between the device and host memory go through a few fixed, pinned host buffers (an
``MmapArena``, page-locked on CUDA) instead of tensors allocated per copy: a device-to-host copy
must land in pinned memory to be asynchronous, and a per-copy allocation would be unbounded host
memory, and on CUDA a pinning call each time. Two rings:

- reduced gradients: the side stream copies this rank's reduced part of a chunk's gradient (in
  the compute dtype) into a buffer; the host worker adds it into the fp32 shard (or, with no
  gradient shard kept, widens it or applies CPU Adam from it) and hands the buffer back;
- uploads, when the compute dtype is not fp32: the side stream writes a master shard downcast
  to the compute dtype into a buffer and copies that to the device, so the upload sends the
  compute dtype's bytes, not fp32's, and makes no fp32 temporary on the device.

A buffer is assigned on the main thread, in ring order, together with the event of its previous
user's release; the job that fills it waits on that event first (on its worker thread: the main
thread never waits for a buffer). Under stream chaos a released buffer is filled with NaN, so a
read that missed its wait sees NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protrain.profiler.host_bytes import STAGING_BUFFERS, ring_bytes
from protrain.runtime.hw import stream_chaos
from protrain.runtime.hw.device import DeviceEvent
from protrain.runtime.hw.host_memory import MmapArena


@dataclass(frozen=True, slots=True)
class Staged:
    """A staging buffer for one copy, and the release of its previous user (wait before filling)."""

    index: int
    buffer: torch.Tensor
    previous_release: DeviceEvent | None

    def wait_until_free(self) -> None:
        """On the filling worker: the previous user has finished with the buffer."""
        if self.previous_release is not None:
            self.previous_release.wait()


class StagingRing:
    """``count`` host buffers of ``numel`` elements of ``dtype``, handed out in ring order."""

    def __init__(self, *, numel: int, dtype: torch.dtype, pin: bool, count: int = STAGING_BUFFERS) -> None:
        element = torch.empty((), dtype=dtype).element_size()
        self._arena = MmapArena(ring_bytes(numel, element, count), pin=pin)
        self.buffers = [self._arena.allocate(numel, dtype) for _ in range(count)]
        self._releases: list[DeviceEvent | None] = [None] * count
        self._next = 0
        self._chaos = stream_chaos.enabled()
        for buffer in self.buffers if self._chaos else ():
            stream_chaos.poison_(buffer)

    @property
    def nbytes(self) -> int:
        return self._arena.capacity_bytes

    def assign(self) -> Staged:
        """The next buffer in ring order (main thread)."""
        index = self._next
        self._next = (index + 1) % len(self.buffers)
        return Staged(index=index, buffer=self.buffers[index], previous_release=self._releases[index])

    def released_by(self, staged: Staged, event: DeviceEvent) -> None:
        """``staged``'s user is done with it once ``event`` has fired (main thread)."""
        self._releases[staged.index] = event

    def released(self, staged: Staged) -> None:
        """Called by the user's job once it has read the buffer: under chaos, poison it."""
        if self._chaos:
            stream_chaos.poison_(staged.buffer)

    def forget(self) -> None:
        """Every user is known done (the workers drained): no release left to wait for."""
        self._releases = [None] * len(self.buffers)

    def close(self) -> None:
        self.buffers = []
        self._arena.close()
