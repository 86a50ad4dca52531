"""The measured peak of device memory over a few updates, for the plan check (measured beside
predicted).

On CUDA it is the allocator's own peak (``torch.cuda.max_memory_allocated`` after a reset): every
byte on the device. On CPU the "device" is the C heap, which also holds whatever else the process
allocates, so the peak is the engine's static device state (persistent chunks, their fp32 state,
the chunk buffers: counted from its tensors) plus the largest rise of ``mallinfo2``'s in-use bytes
above the reading when the probe started, read at every module's forward hook and every trainable
parameter's gradient hook (where activations and gradient buffers peak). Peaks between hooks
(inside one operator) are not seen: the CPU figure can only be low, never high, by that much.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runtime.device import DeviceInfo, malloc_in_use_bytes


class PeakMemoryProbe:
    def __init__(self, model: nn.Module, device: DeviceInfo, *, static_device_bytes: int) -> None:
        self.model = model
        self.device = device
        self.static_device_bytes = static_device_bytes
        self.active = False
        self._base = 0
        self._highest = 0
        self._handles: list[Any] = []

    def start(self) -> None:
        if self.active:
            return
        self.active = True
        if self.device.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device.device)
            return
        self._base = self._highest = malloc_in_use_bytes()
        for module in self.model.modules():
            self._handles.append(module.register_forward_hook(lambda *_: self._sample()))
        for param in self.model.parameters():
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(lambda _: self._sample()))

    def _sample(self) -> None:
        self._highest = max(self._highest, malloc_in_use_bytes())

    def stop(self) -> int:
        """The peak device bytes since ``start``."""
        self.active = False
        if self.device.is_cuda:
            return int(torch.cuda.max_memory_allocated(self.device.device))
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return self.static_device_bytes + max(0, self._highest - self._base)
