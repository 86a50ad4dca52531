"""Host memory for swapped activations: page-aligned regions outside the C heap.

Swapped activations need host buffers of sizes that change every step. Allocating each from
malloc would (on CPU) count them as device-tier bytes and (on CUDA) need pinning per tensor, so
they are carved from ``MmapArena`` segments with a bump pointer instead. Every allocation of a
step is released by the end of its backward; when none is live, the pointer goes back to the
start. A step that outgrew the segments gets one segment of the whole size next time, so after
the first step one region serves every step with no system calls.

Under stream chaos (stream_chaos.py) a freed allocation is checked (the copy that last wrote it
must have finished, else ``StreamChaosError``) and filled with 0xFF bytes (NaN in every float
dtype), so a swap-in that reads it through a missing wait brings NaN back.
"""

from __future__ import annotations

import torch

from protrain.runtime.hw import stream_chaos
from protrain.runtime.hw.device import DeviceEvent
from protrain.runtime.hw.host_memory import PAGE_BYTES, MmapArena

_MIN_SEGMENT_BYTES = 16 << 20


class HostActivationPool:
    """Bump allocator over mmap segments (pinned on CUDA), reset when nothing is live."""

    def __init__(self, *, pin: bool = False) -> None:
        self._pin = pin
        self._segments: list[MmapArena] = []
        self._current = 0
        self._live = 0
        self._high_water = 0
        self._used = 0
        self.capacity_bytes = 0
        self._chaos = stream_chaos.enabled()

    @property
    def live_allocations(self) -> int:
        return self._live

    @property
    def used_bytes(self) -> int:
        """Bytes handed out since the pool last emptied (page-rounded)."""
        return self._used

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor of ``nbytes``; give it back with ``free`` once it is not needed."""
        rounded = max(PAGE_BYTES, -(-nbytes // PAGE_BYTES) * PAGE_BYTES)
        while self._current < len(self._segments):
            segment = self._segments[self._current]
            if segment.capacity_bytes - segment.used_bytes >= rounded:
                break
            self._current += 1
        else:
            self._segments.append(MmapArena(max(rounded, _MIN_SEGMENT_BYTES), pin=self._pin))
            self.capacity_bytes += self._segments[-1].capacity_bytes
        self._live += 1
        self._used += rounded
        self._high_water = max(self._high_water, self._used)
        return self._segments[self._current].allocate(nbytes, torch.uint8)

    def free(self, buffer: torch.Tensor, *, written_by: DeviceEvent | None = None) -> None:
        """``buffer`` (from ``allocate``) is no longer used; the last one rewinds the pool.
        ``written_by``: the copy into it, if the caller still holds its event (it must have
        finished: chaos checks)."""
        if self._live <= 0:
            raise RuntimeError("host activation pool: free without a live allocation")
        if self._chaos:
            stream_chaos.check_released(written_by, "a swap buffer")
            stream_chaos.poison_(buffer)
        self._live -= 1
        if self._live == 0:
            self._rewind()

    def _rewind(self) -> None:
        if len(self._segments) > 1:
            # The step needed several segments: replace them by one that holds the whole step.
            for segment in self._segments:
                segment.close()
            self._segments = [MmapArena(self._high_water, pin=self._pin)]
            self.capacity_bytes = self._segments[0].capacity_bytes
        for segment in self._segments:
            segment.used_bytes = 0
        self._current = 0
        self._used = 0

    def close(self) -> None:
        for segment in self._segments:
            segment.close()
        self._segments = []
        self.capacity_bytes = 0
