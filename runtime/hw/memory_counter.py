"""One device memory counter, read at the same hooks, for the profiler and the plan check.

The profile's transient peak (``runtime.planning.model_profiling``) and the plan check's measured
peak (``runtime.planning.memory_probe``) are compared with each other through the plan: a re-plan
fires when the measured peak exceeds the prediction made from the profile. Read from two
counters, they would differ by what the counters differ by, and re-plans would fire on that. So
both read ``device_peak_since_last_sample`` at the hooks ``sample_at_hooks`` places: after every
module's forward and after every trainable parameter's gradient is accumulated.

- On CUDA a reading is the allocator's peak (``max_memory_allocated``) since the previous
  reading, which then resets it (``reset_peak_memory_stats``): the reading at a hook is the
  highest allocation since the hook before, peaks inside operators included, so attributing a
  peak to the block that ran survives.
- On CPU under the device wall (``runtime.hw.device_wall``, in an engine call) a reading is the
  engine's count of its device storages at its highest since the previous reading, as on CUDA.
- Otherwise on CPU the device tier is the C heap: a reading is ``mallinfo2``'s in-use bytes at
  the hook (peaks inside an operator are not seen: the figure can only be low by that much).

Because a CUDA reading resets the peak, a reading belongs to every reader at once: each one
open a ``PeakWindow`` receives every reading taken on its device while it is open, whoever takes
it (a profiling step inside a plan check's updates, a second engine of the process), so no reader
loses a peak another reader's reset took.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from protrain.runtime.hw import device_wall
from protrain.runtime.hw.device import DeviceInfo, device_allocated_bytes

_lock = threading.Lock()
"""Readings come from the main thread (forward hooks) and autograd's threads (gradient hooks)."""
_open_windows: list[PeakWindow] = []


def _read_and_reset(info: DeviceInfo) -> int:
    if info.is_cuda:
        peak = int(torch.cuda.max_memory_allocated(info.device))
        torch.cuda.reset_peak_memory_stats(info.device)
        return peak
    account = device_wall.counting_account()
    if account is not None:
        return account.take_highest()
    return device_allocated_bytes(info)


def _take(info: DeviceInfo) -> int:
    """One reading, handed to every window open on the device (on CPU under the device wall,
    on the same engine's count); the caller holds ``_lock``."""
    reading = _read_and_reset(info)
    account = None if info.is_cuda else device_wall.counting_account()
    for window in _open_windows:
        if window.info.device == info.device and window.account is account:
            window.highest = max(window.highest, reading)
    return reading


def device_peak_since_last_sample(info: DeviceInfo) -> int:
    """Bytes on the device: on CUDA the highest allocation since the last reading (then reset),
    on CPU the C heap's in-use bytes now. Every open ``PeakWindow`` on the device sees it."""
    with _lock:
        return _take(info)


def peak_reader(info: DeviceInfo) -> Callable[[], int]:
    """The reading function for a sampler starting now: what came before is read off first
    (to the windows open), so that the first reading is about the allocation now."""
    device_peak_since_last_sample(info)
    return lambda: device_peak_since_last_sample(info)


class PeakWindow:
    """The highest reading on one device between ``open`` and ``close``, whoever took it, and
    the allocation at ``open`` (``base``)."""

    def __init__(self, info: DeviceInfo) -> None:
        self.info = info
        self.base = 0
        self.highest = 0
        self.account: device_wall.Account | None = None

    def open(self) -> None:
        with _lock:
            self.account = None if self.info.is_cuda else device_wall.counting_account()
            _take(self.info)  # the peak so far belongs to the windows already open
            self.base = self.highest = device_allocated_bytes(self.info)
            _open_windows.append(self)

    def close(self) -> int:
        """The highest reading while open (a last one taken now)."""
        with _lock:
            _take(self.info)
            _open_windows.remove(self)
        return self.highest


def sample_at_hooks(
    model: nn.Module,
    *,
    after_forward: Callable[[], None],
    after_gradient: Callable[[torch.Tensor], None],
) -> list[Any]:
    """Call ``after_forward()`` after every module's forward and ``after_gradient(param)`` after
    each trainable parameter's gradient is accumulated (where activations and gradients peak);
    the hook handles, for the caller to remove."""
    handles = [module.register_forward_hook(lambda *_: after_forward()) for module in model.modules()]
    for param in model.parameters():
        if param.requires_grad:
            handles.append(param.register_post_accumulate_grad_hook(after_gradient))
    return handles
