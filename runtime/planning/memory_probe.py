"""The measured peak of device memory over a few updates, for the plan check (measured beside
predicted).

It reads the profiler's counter (``runtime.hw.memory_counter``), so that the two figures the plan
check compares through the plan differ by what the plan gets wrong, not by how they were
measured. On CUDA that is the allocator's high-water mark, and on CPU under the device wall
(``runtime.hw.device_wall``) the engine's own count's: every byte on the device, and a high-water
mark needs no reading between the window's opening and its closing (nor do readings others take
meanwhile lose it: each goes to every open window). So the probe places no hooks there: readings
at every module and every gradient would cost time in the very updates that are timed
(docs/decisions/0011-memory-probe-without-hooks-on-cuda.md).
Otherwise on CPU the "device" is the C heap, which also holds whatever else the
process allocates, so the peak is the engine's static device state (persistent chunks, their
fp32 state, the chunk buffers: counted from its tensors) plus the largest rise of the heap's
in-use bytes above the reading when the probe started, read at the profiler's hooks (after every
module's forward and every gradient: the heap has no high-water mark; peaks inside one
operator are not seen: the CPU figure can only be low, never high, by that much).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from protrain.runtime.hw.device import DeviceInfo, counts_every_byte
from protrain.runtime.hw.memory_counter import (
    PeakWindow,
    device_peak_since_last_sample,
    sample_at_hooks,
)


class PeakMemoryProbe:
    def __init__(self, model: nn.Module, device: DeviceInfo, *, static_device_bytes: int) -> None:
        self.model = model
        self.device = device
        self.static_device_bytes = static_device_bytes
        self.active = False
        self._exact = device.is_cuda
        self._window = PeakWindow(device)
        self._handles: list[Any] = []

    def start(self) -> None:
        if self.active:
            return
        self.active = True
        self._exact = counts_every_byte(self.device)
        self._window.open()
        if not self._exact:
            self._handles = sample_at_hooks(
                self.model, after_forward=self._sample, after_gradient=lambda _: self._sample()
            )

    def _sample(self) -> None:
        device_peak_since_last_sample(self.device)  # the window takes the reading

    def stop(self) -> int:
        """The peak device bytes since ``start`` (stopped already: the figure it stopped with)."""
        if self.active:
            self.active = False
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._window.close()
        if self._exact:
            # What the device held at the start beyond the engine's static state (the caller's
            # tensors, another engine) is not this plan's: the prediction leaves it out too.
            outside = max(0, self._window.base - self.static_device_bytes)
            return self._window.highest - outside
        return self.static_device_bytes + max(0, self._window.highest - self._window.base)
