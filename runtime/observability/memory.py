"""Memory over one update: the device peak and reserved bytes, the host regions, SSD traffic.

- Device peak (``memory/max_active(GiB)``, torchtitan's name) and reserved
  (``memory/max_reserved(GiB)``). On CUDA: the profiler's counter (``runtime.hw.memory_counter``)
  read at the update's start, at the end of each forward (where activations peak) and at its
  end, plus any reading another reader took meanwhile (the plan check's probe at every hook);
  a reading is the allocator's peak since the one before, so nothing in between is missed. The
  reserved high-water is read before each reading resets it (it falls only on ``empty_cache``,
  which training never calls). On CPU the "device" is the C heap, which holds the rest of the
  process too, and one reading walks its free lists (a hundred microseconds or more, a good part
  of what logging costs a small model's step): it is read at each forward's end only, and the
  peak is the engine's static device state plus the heap's rise above its reading when the
  first update of the plan began, as the plan check counts it
  (``runtime.planning.memory_probe``, which reads it at the start of every window it measures).
  A peak inside backward is not seen, and what else the process allocates as it goes (a data
  loader's buffers) counts as the engine's: a stand-in for the device's figure, not more. Under
  the device wall (``runtime.hw.device_wall``) the CPU reads the engine's own count as CUDA reads
  its allocator: every peak, this engine's tensors only (reserved is then the same figure).
- Host (``memory/host_in_use(GiB)``, ``memory/host_pinned(GiB)``): every host region of the
  runtime alive (``runtime.hw.host_memory.host_arena_bytes``: chunk state, the swap pool), and the
  process's resident high-water (``memory/host_max_rss(GiB)``).
- SSD (``ssd/written(GiB)``, ``ssd/read(GiB)``): activation bytes written and read back during
  the update (the store's payload counters).
"""

from __future__ import annotations

import resource
import sys

from protrain.runtime.activations.ssd_store import StoreStats
from protrain.runtime.hw.device import DeviceInfo, counts_every_byte, cuda_reserved_peak_bytes, malloc_heap_bytes
from protrain.runtime.hw.host_memory import host_arena_bytes
from protrain.runtime.hw.memory_counter import PeakWindow, device_peak_since_last_sample

GIB = float(1 << 30)
_RSS_UNIT = 1 if sys.platform == "darwin" else 1024
"""``ru_maxrss`` is in bytes on macOS, KiB on Linux."""


class MemoryMeter:
    """The readings of one engine's updates (see the module docstring)."""

    def __init__(self, device: DeviceInfo) -> None:
        self.device = device
        self._window = PeakWindow(device)  # CUDA
        self._open = False
        self._base: int | None = None
        """CPU: the heap in use when the plan's first update began (``rebase`` forgets it)."""
        self._highest = self._reserved = 0
        self._ssd_seen = (0, 0)
        self._exact = device.is_cuda
        """The readings count every byte (CUDA, or the device wall on CPU): a window's peak."""

    def start_window(self) -> None:
        """An update's first forward begins (a window a failed backward abandoned is dropped)."""
        if self._open and self._exact:
            self._window.close()
        self._exact = counts_every_byte(self.device)
        if self._exact:
            self._reserved = cuda_reserved_peak_bytes(self.device) if self.device.is_cuda else 0
            self._window.open()
        else:
            if self._base is None:
                self._base = malloc_heap_bytes()[0]
            self._highest = self._reserved = 0
        self._open = True

    def rebase(self) -> None:
        """Another plan is in force (its static state differs): CPU readings start over."""
        self._base = None

    def sample(self) -> None:
        """A reading now (a forward ended)."""
        if not self._open:
            return
        if self._exact:
            if self.device.is_cuda:
                self._reserved = max(self._reserved, cuda_reserved_peak_bytes(self.device))
            device_peak_since_last_sample(self.device)  # the window takes it
        else:
            in_use, held = malloc_heap_bytes()
            self._highest, self._reserved = max(self._highest, in_use), max(self._reserved, held)

    def take(self, *, static_device_bytes: int, ssd: StoreStats | None) -> dict[str, float]:
        """The update's figures (GiB); the window closes."""
        values: dict[str, float] = {}
        device: tuple[int, int] | None = None  # (peak, reserved)
        if self._open and self._exact:
            peak = self._window.close()
            reserved = cuda_reserved_peak_bytes(self.device) if self.device.is_cuda else peak
            device = (peak, max(self._reserved, reserved))
        elif self._open and self._highest and self._base is not None:  # a forward was read
            device = (static_device_bytes + max(0, self._highest - self._base), self._reserved)
        self._open = False
        if device is not None:
            values["memory/max_active(GiB)"] = device[0] / GIB
            values["memory/max_reserved(GiB)"] = device[1] / GIB
        held, pinned = host_arena_bytes()
        values["memory/host_in_use(GiB)"] = held / GIB
        values["memory/host_pinned(GiB)"] = pinned / GIB
        values["memory/host_max_rss(GiB)"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _RSS_UNIT / GIB
        if ssd is not None:
            written, read = self._ssd_delta(ssd)
            values["ssd/written(GiB)"] = written / GIB
            values["ssd/read(GiB)"] = read / GIB
        return values

    def _ssd_delta(self, ssd: StoreStats) -> tuple[int, int]:
        """Bytes since the last update; a store's counters start at zero (a new plan's new store)."""
        last_written, last_read = self._ssd_seen
        if ssd.bytes_written < last_written or ssd.bytes_read < last_read:
            last_written = last_read = 0
        self._ssd_seen = (ssd.bytes_written, ssd.bytes_read)
        return ssd.bytes_written - last_written, ssd.bytes_read - last_read

    def close(self) -> None:
        if self._open and self._exact:
            self._window.close()
        self._open = False
