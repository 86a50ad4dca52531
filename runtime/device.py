"""The device layer: which device a rank computes on, side streams, events, host memory and
memory statistics. Nothing else in the runtime talks to ``torch.cuda`` directly.

Real on CUDA; on CPU a faithful stand-in so that every path runs and is tested without a GPU:
- a side stream is one worker thread that runs submitted copies in order (as a CUDA stream
  does), and an event is set when the work queued before it has finished;
- "pinned" host memory is a plain allocation (``pin_memory`` raises on the CPU build); host tiers
  are carved from an anonymous-mmap arena, so glibc's ``mallinfo2`` counts only what the device
  tier allocates, which lets tests measure the device tier independently of our bookkeeping.
"""

from __future__ import annotations

import ctypes
import mmap
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

PAGE_BYTES = mmap.PAGESIZE


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    device: torch.device
    backend: str
    """Process-group backend that fits the device: nccl on CUDA, gloo on CPU."""

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def autocast_type(self) -> str:
        return self.device.type


def select_device(local_rank: int) -> DeviceInfo:
    """CUDA device ``local_rank`` when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return DeviceInfo(torch.device("cuda", index), "nccl")
    return DeviceInfo(torch.device("cpu"), "gloo")


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def synchronize(info: DeviceInfo) -> None:
    """Wait for queued device work (for honest step times)."""
    if info.is_cuda:
        torch.cuda.synchronize(info.device)


# ------------------------------------------------------------------------------------------------
# Streams and events
# ------------------------------------------------------------------------------------------------


class DeviceEvent:
    """Marks a point in a stream's work; ``wait()`` blocks the host until it is reached."""

    def __init__(self, cuda_event: Any = None) -> None:
        self._cuda_event = cuda_event
        self._done = threading.Event()
        self._error: BaseException | None = None

    @classmethod
    def completed(cls) -> DeviceEvent:
        """An event that has already happened (for work that needed no stream)."""
        event = cls()
        event._finish()
        return event

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def query(self) -> bool:
        if self._cuda_event is not None:
            return bool(self._cuda_event.query())
        return self._done.is_set()

    def wait(self) -> None:
        """Block until the work before this event has run; re-raise its failure, if any."""
        if self._cuda_event is not None:
            self._cuda_event.synchronize()
            return
        self._done.wait()
        if self._error is not None:
            raise RuntimeError("work on the side stream failed") from self._error


class SideStream:
    """An ordered queue of device work beside the compute stream.

    CUDA: a ``torch.cuda.Stream``; ``submit`` runs the callable under that stream and records an
    event. CPU: one daemon worker thread runs callables in submission order; the event is set
    when the callable returns. Random ops must never run here (DESIGN section 6).
    """

    def __init__(self, info: DeviceInfo, name: str = "protrain-side-stream") -> None:
        self.info = info
        self._closed = False
        if info.is_cuda:
            self._cuda_stream = torch.cuda.Stream(device=info.device)
            return
        self._cuda_stream = None
        self._failure: BaseException | None = None
        """The first work that failed. Like a CUDA error it sticks: every later event reports
        it without running its work, since that work may depend on what failed (so a drain,
        which waits for the last event only, cannot miss a failure)."""
        self._work: queue.SimpleQueue[tuple[Callable[[], None], DeviceEvent] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            work, event = item
            del item
            if self._failure is None:
                try:
                    work()
                except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the event
                    self._failure = err
            # Drop the work, and what its closure holds (a gradient buffer, say), before the event
            # says it is done: whoever waited may count on it being freed.
            del work
            event._finish(self._failure)
            del event

    def submit(self, work: Callable[[], None]) -> DeviceEvent:
        """Queue ``work`` after everything submitted before; returns its completion event."""
        if self._closed:
            raise RuntimeError("side stream is closed")
        if self._cuda_stream is not None:
            # The side stream must not start before the compute stream has produced its inputs.
            self._cuda_stream.wait_stream(torch.cuda.current_stream(self.info.device))
            with torch.cuda.stream(self._cuda_stream):
                work()
                cuda_event = torch.cuda.Event()
                cuda_event.record(self._cuda_stream)
            return DeviceEvent(cuda_event)
        event = DeviceEvent()
        self._work.put((work, event))
        return event

    def make_compute_wait(self, event: DeviceEvent) -> None:
        """Make later compute-stream work wait for ``event`` (CUDA: on the device, without
        blocking the host; CPU: the host waits, since compute runs on the host)."""
        if event._cuda_event is not None:
            torch.cuda.current_stream(self.info.device).wait_event(event._cuda_event)
        else:
            event.wait()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._cuda_stream is None:
            self._work.put(None)
            self._thread.join()


# ------------------------------------------------------------------------------------------------
# Host memory
# ------------------------------------------------------------------------------------------------


class MmapArena:
    """Host tensors carved from one anonymous mmap at page-aligned offsets.

    Exact-size allocations with no allocator rounding (PyTorch's caching host allocator rounds
    pinned blocks to powers of two), invisible to malloc statistics, freed all at once. On CUDA
    the region is page-locked with ``cudaHostRegister`` so copies from it are asynchronous.
    """

    def __init__(self, capacity_bytes: int, *, pin: bool = False) -> None:
        self.capacity_bytes = _round_up(max(capacity_bytes, PAGE_BYTES), PAGE_BYTES)
        self._map = mmap.mmap(-1, self.capacity_bytes)
        self._base = torch.frombuffer(self._map, dtype=torch.uint8)
        self.used_bytes = 0
        self._pinned = False
        if pin:
            _cuda_host_register(self._base)
            self._pinned = True

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A fresh tensor of exactly ``numel`` elements (zero-filled: mmap pages start zeroed)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        start = self.used_bytes
        end = start + nbytes
        if end > self.capacity_bytes:
            raise MemoryError(
                f"host arena full: {nbytes:,} more bytes requested, {self.capacity_bytes - start:,} free"
            )
        self.used_bytes = _round_up(end, PAGE_BYTES)
        return self._base[start:end].view(dtype)

    def contains(self, tensor: torch.Tensor) -> bool:
        begin = self._base.data_ptr()
        return begin <= tensor.data_ptr() < begin + self.capacity_bytes

    def close(self) -> None:
        """Release the region. Tensors from it must no longer be used."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._base.data_ptr())
            self._pinned = False
        del self._base
        self._map.close()


def _cuda_host_register(region: torch.Tensor) -> None:
    result = torch.cuda.cudart().cudaHostRegister(region.data_ptr(), region.numel(), 0)
    if int(result) != 0:
        raise RuntimeError(f"cudaHostRegister failed with error {int(result)}")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# ------------------------------------------------------------------------------------------------
# Memory statistics
# ------------------------------------------------------------------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_libc: Any = None


def malloc_in_use_bytes() -> int:
    """Bytes the C heap has handed out (glibc ``mallinfo2``: in-use chunks plus mmapped blocks).

    On CPU this measures the device tier from outside the runtime's own counters: the host tier
    lives in ``MmapArena`` regions, which malloc does not see. Process-wide; compare deltas.
    """
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL("libc.so.6")
        _libc.mallinfo2.restype = _MallInfo2
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def release_free_memory(info: DeviceInfo) -> None:
    """Hand memory freed but still held by the allocator back: the C heap's free pages to the
    OS (glibc ``malloc_trim``), and on CUDA the caching allocator's unused blocks. Called after
    profiling: the steps' activations and gradients are gone, and the chunk state allocated next
    (an mmap arena on CPU, pinned memory on CUDA) cannot reuse the pages glibc would keep."""
    if info.is_cuda:
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def device_allocated_bytes(info: DeviceInfo) -> int:
    """Bytes allocated on the device now: CUDA's allocator statistics, or the C heap on CPU."""
    if info.is_cuda:
        return int(torch.cuda.memory_allocated(info.device))
    return malloc_in_use_bytes()
