"""The profile's transient peak and the plan check's measured peak come from one counter read at
the same hooks (``runtime.hw.memory_counter``): on CPU the same step gives the same peak through
either; on CUDA (a fake allocator here) a reading is the peak since the last one, then reset,
and every open window gets every reading, so neither reader loses a peak to the other's reset."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import protrain.runtime.hw.memory_counter as memory_counter
from protrain.runtime.data.batches import default_loss
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.memory_counter import PeakWindow, device_peak_since_last_sample, peak_reader
from protrain.runtime.planning.memory_probe import PeakMemoryProbe
from protrain.runtime.planning.model_profiling import _one_step
from tests.helpers import lm_batches, tiny_gpt

CPU = DeviceInfo(torch.device("cpu"), "gloo")


def test_the_profile_and_the_plan_check_read_one_counter_at_the_same_hooks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One forward and backward of plain PyTorch, measured once by the profiler's instruments and
    once by the plan check's probe: the same number of readings of the one counter (one per
    module call and per trainable parameter's gradient, plus two at the start or at either end),
    and peaks above the start within a few KiB of each other."""
    model = tiny_gpt()
    batch = lm_batches(micro_batch_size=2, accumulation=1, world_size=1).batch(0, 0, 0)
    readings: list[int] = []
    read = memory_counter._read_and_reset

    def counted(info: DeviceInfo) -> int:
        readings.append(read(info))
        return readings[-1]

    def plain_step() -> None:
        for param in model.parameters():
            param.grad = None
        model(**batch).loss.backward()

    plain_step()  # torch's one-off allocations before anything is measured
    monkeypatch.setattr(memory_counter, "_read_and_reset", counted)
    hooks = len(list(model.modules())) + sum(1 for p in model.parameters() if p.requires_grad)

    for param in model.parameters():
        param.grad = None
    gc.collect()
    _one_step(model, lambda: model(**batch), default_loss, [], CPU, instruments=True, chunked=None)
    profiled, readings[:] = list(readings), []
    # The profiler's start: history read off, then its base; the probe's: the window's open.
    assert len(profiled) >= hooks + 2
    profile_peak = max(profiled) - profiled[1]

    for param in model.parameters():
        param.grad = None
    gc.collect()
    probe = PeakMemoryProbe(model, CPU, static_device_bytes=0)
    probe.start()
    out = model(**batch)  # held through backward, as a training loop holds it (and the profile)
    out.loss.backward()
    del out
    probe_peak = probe.stop()
    assert len(readings) == len(profiled)
    assert probe_peak > 100_000, "gradients and activations were seen"
    assert abs(profile_peak - probe_peak) <= 16 * 1024, (profile_peak, probe_peak)


class FakeCudaAllocator:
    """``torch.cuda``'s allocated, peak and reset, over a count the test moves."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.allocated = self.peak = 1000
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)

    def reset(self, device: Any = None) -> None:
        self.peak = self.allocated

    def transient(self, nbytes: int) -> None:
        """``nbytes`` allocated and freed between two readings."""
        self.peak = max(self.peak, self.allocated + nbytes)


def test_on_cuda_a_reading_is_the_peak_since_the_last_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-hook attribution: each reading sees only what came after the reading before."""
    gpu = FakeCudaAllocator(monkeypatch)
    info = DeviceInfo(torch.device("cuda", 0), "nccl")
    gpu.transient(5000)  # before the sampler started: not its peak
    read = peak_reader(info)
    assert read() == 1000
    gpu.transient(300)
    assert read() == 1300
    assert read() == 1000
    gpu.allocated = 1200
    gpu.transient(50)
    assert read() == 1250


def test_on_cuda_every_open_window_gets_every_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """A profiling step inside a plan check's updates: the profiler's readings reset the peak, and
    the probe's window still sees what they read; history from before a window opened is not
    its peak."""
    gpu = FakeCudaAllocator(monkeypatch)
    info = DeviceInfo(torch.device("cuda", 0), "nccl")
    gpu.transient(9000)
    probe = PeakWindow(info)
    probe.open()
    assert probe.base == probe.highest == 1000
    gpu.transient(700)
    device_peak_since_last_sample(info)  # the other reader's reading (and reset)
    gpu.transient(200)
    assert probe.close() == 1700
    device_peak_since_last_sample(info)
    assert probe.highest == 1700, "a closed window takes no more readings"


def test_a_probe_stopped_twice_keeps_its_figure() -> None:
    model = tiny_gpt()
    probe = PeakMemoryProbe(model, CPU, static_device_bytes=123)
    probe.start()
    first = probe.stop()
    assert first >= 123 and probe.stop() == first
    assert not any(module._forward_hooks for module in model.modules()), "its hooks left the model"


def test_where_the_counter_keeps_a_high_water_mark_the_probe_reads_it_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA (and on CPU under the device wall) the counter keeps a high-water mark: the plan
    check's probe reads it when its window opens and when it closes, not at every module and
    gradient (a reading costs about 60 us on CUDA, and that was a thousand readings per GPT-2-XL
    micro-batch in the updates whose speed is timed), and still gets the peak in between."""
    gpu = FakeCudaAllocator(monkeypatch)
    readings: list[int] = []
    read = memory_counter._read_and_reset

    def counted(info: DeviceInfo) -> int:
        readings.append(read(info))
        return readings[-1]

    monkeypatch.setattr(memory_counter, "_read_and_reset", counted)
    model = tiny_gpt()
    batch = lm_batches(micro_batch_size=2, accumulation=1, world_size=1).batch(0, 0, 0)
    probe = PeakMemoryProbe(model, DeviceInfo(torch.device("cuda", 0), "nccl"), static_device_bytes=1000)
    probe.start()
    model(**batch).loss.backward()  # on the host: whatever a hook read, it read the fake allocator
    gpu.transient(5000)
    assert probe.stop() == 6000
    assert len(readings) == 2, f"{len(readings)} readings"


def test_the_plan_checks_peak_leaves_out_what_the_device_held_beside_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prediction is the engine's (its static state plus what a step adds); the measured
    peak is the device's. What the device held beyond the engine's state when the probe started
    (the caller's tensors, another engine) is taken off, so it neither fails the check nor
    triggers a re-plan (before: 1,500 measured against the engine's 900)."""
    gpu = FakeCudaAllocator(monkeypatch)  # 1,000 allocated: 400 the engine's, 600 someone else's
    probe = PeakMemoryProbe(tiny_gpt(), DeviceInfo(torch.device("cuda", 0), "nccl"), static_device_bytes=400)
    probe.start()
    gpu.transient(500)
    assert probe.stop() == 900
