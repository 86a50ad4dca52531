"""The device layer: which device a rank computes on, side streams, events and memory
statistics (host memory regions: runtime/hw/host_memory.py). Nothing else in the runtime talks to
``torch.cuda`` directly.

Real on CUDA; on CPU a faithful stand-in so that every path runs and is tested without a GPU:
- a side stream is one worker thread that runs submitted copies and collectives in order, on
  both devices (on CUDA it issues them on a CUDA stream); the host worker is a thread for host
  arithmetic; an event is set when the work queued before it has finished. CPU and CUDA run one
  structure, so the CPU suite tests the CUDA ordering too (with stream chaos, stream_chaos.py);
- "pinned" host memory is a plain allocation (``pin_memory`` raises on the CPU build); host tiers
  are carved from an anonymous-mmap arena (runtime/hw/host_memory.py), so glibc's ``mallinfo2``
  counts only what the device tier allocates, which lets tests measure the device tier
  independently of our bookkeeping.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from protrain.runtime.hw import device_wall, stream_chaos
from protrain.runtime.hw.sanitizer_threads import active_sanitizer_mode, sanitized_here


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


def host_worker_threads(info: DeviceInfo) -> int:
    """Intra-op threads for the host worker's arithmetic (CPU Adam, gradient adds, norms). On CPU
    compute runs on the same cores, so one: the worker must not take them from backward. On CUDA
    compute runs on the GPU, and the host's cores are free but for the main thread issuing
    kernels and the side-stream thread: this rank's share of the cores the process may use
    (``LOCAL_WORLD_SIZE`` ranks per node), less those two. CPU Adam over a few billion
    parameters on one thread would take seconds per update and could not hide behind a step."""
    if not info.is_cuda:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    return max(1, cores // ranks_here - 2)


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def synchronize(info: DeviceInfo) -> None:
    """Wait for queued device work (for honest step times)."""
    if info.is_cuda:
        torch.cuda.synchronize(info.device)


# ------------------------------------------------------------------------------------------------
# Streams, events and the host worker
# ------------------------------------------------------------------------------------------------
#
# One structure on both devices. A side stream is a worker thread that runs submitted jobs in
# order; on CUDA each job is issued on a CUDA stream (after the compute stream's work queued
# before the submit), so device copies and collectives overlap compute, and the thread may block
# on a host event (a staging buffer coming free, an update the upload must follow) without
# blocking the main thread. The host worker is a thread for host arithmetic (gradient adds into
# host shards, CPU Adam, downcasts): it waits on device events before touching a buffer. The
# main thread only ever waits on an event. Chaos (stream_chaos.py) delays jobs, or holds each
# back until its event is waited on, to expose a missing wait on CPU.


class DeviceEvent:
    """Marks a point in a worker's jobs; ``wait()`` blocks the host until it is reached (and, on
    CUDA, until the device work the job issued has finished)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        """The job ran (CPU) or issued its device work (CUDA)."""
        self._cuda_event: Any = None
        self._error: BaseException | None = None
        self._demand: Callable[[], None] | None = None
        """Lazy chaos: asks the worker to run every job up to this one."""
        self._source = ("the side stream", "")
        """Where the job runs, for the error a failure raises."""

    @classmethod
    def completed(cls) -> DeviceEvent:
        """An event that has already happened (for work that needed no stream)."""
        event = cls()
        event._finish(None, None)
        return event

    def _finish(self, error: BaseException | None, cuda_event: Any) -> None:
        self._error = error
        self._cuda_event = cuda_event
        self._done.set()

    def query(self) -> bool:
        """Whether the work has finished, without waiting (and, under lazy chaos, without asking
        for it: lazily held work has not happened)."""
        if not self._done.is_set():
            return False
        return self._cuda_event is None or bool(self._cuda_event.query())

    def wait_issued(self) -> None:
        """Block until the job has run on its worker; re-raise its failure, if any."""
        if self._demand is not None:
            self._demand()
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"work on {self._source[0]} failed ({self._source[1]})") from self._error

    def wait(self) -> None:
        """Block until the work before this event is done, device work included."""
        self.wait_issued()
        if self._cuda_event is not None:
            self._cuda_event.synchronize()
        chaos = getattr(_worker_chaos, "chaos", None)
        if chaos is not None:
            # Random chaos on a worker: the job goes on only a while after the work it waited
            # for, so a buffer that work's worker reuses without its own wait is overwritten first.
            chaos.delay()


_worker_chaos = threading.local()
"""On a worker thread under stream chaos: its ``StreamChaos`` (``chaos``)."""


class _OrderedWorker:
    """One daemon thread running submitted jobs in submission order (see the section comment).

    A failure sticks, like a CUDA error: every later event reports it without running its job,
    since that job may depend on what failed (so a drain, which waits for the last event only,
    cannot miss a failure)."""

    def __init__(
        self,
        name: str,
        *,
        kind: str,
        threads: int,
        cuda_stream: Any = None,
        device: torch.device | None = None,
        wall_call: tuple[device_wall.Account, str] | None = None,
    ) -> None:
        """``threads``: the intra-op threads of the worker's own jobs, set on its thread before
        the first. torch sets a new thread's count, at its first parallel op, from the process
        value the last ``set_num_threads`` left, whichever thread called it: without its own, the
        side stream's copies would run on the host worker's one thread, and gathers slow down
        (docs/decisions/0004-worker-thread-counts.md). ``wall_call``: the device wall's engine call the jobs count
        to (device work), None for host work."""
        self.name = name
        self.kind = kind
        self._threads = threads
        self._cuda_stream = cuda_stream
        self._device = device
        self._chaos = stream_chaos.for_worker(name)
        self._work: queue.SimpleQueue[tuple[Callable[[], None], DeviceEvent, int, Any] | None] = queue.SimpleQueue()
        self._submitted = 0
        self._demanded = 0
        self._demand_changed = threading.Condition()
        self._failure: BaseException | None = None
        self._closed = False
        self._wall_call = wall_call
        self._sanitizer = active_sanitizer_mode()  # the creating thread's: TORCH_CUDA_SANITIZER=1
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], None]) -> DeviceEvent:
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        self._submitted += 1
        sequence = self._submitted
        event = DeviceEvent()
        event._source = (self.kind, self.name)
        if self._chaos is not None and self._chaos.lazy:
            event._demand = lambda: self._demand_up_to(sequence)
        compute_ready = None
        if self._cuda_stream is not None:
            # The job must not start before the compute stream has produced its inputs.
            compute_ready = torch.cuda.Event()
            compute_ready.record(torch.cuda.current_stream(self._device))
        self._work.put((work, event, sequence, compute_ready))
        return event

    def _demand_up_to(self, sequence: int) -> None:
        with self._demand_changed:
            if sequence > self._demanded:
                self._demanded = sequence
                self._demand_changed.notify()

    def _demand_reached(self, sequence: int) -> bool:
        """Whether job ``sequence`` was demanded (call holding ``_demand_changed``)."""
        return self._demanded >= sequence

    def _run(self) -> None:
        # torch initialises a thread's count lazily, at its first parallel op, from the process
        # value: take that first (get_num_threads does), then set the worker's own, which stays.
        torch.get_num_threads()
        torch.set_num_threads(self._threads)
        _worker_chaos.chaos = self._chaos
        if self._device is not None:
            torch.cuda.set_device(self._device)
        with sanitized_here(self._sanitizer):
            if self._wall_call is None:
                self._serve()
                return
            account, _ = self._wall_call
            with device_wall.engine_call(account, f"a job on the side stream {self.name}"):
                self._serve()

    def _serve(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            work, event, sequence, compute_ready = item
            del item
            if self._chaos is not None:
                if self._chaos.lazy:
                    with self._demand_changed:
                        self._demand_changed.wait_for(partial(self._demand_reached, sequence))
                self._chaos.delay()
            cuda_event = None
            if self._failure is None:
                try:
                    cuda_event = self._issue(work, compute_ready)
                except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the event
                    self._failure = err
            # Drop the work, and what its closure holds (a gradient buffer, say), before the event
            # says it is done: whoever waited may count on it being freed.
            del work
            event._finish(self._failure, cuda_event)
            del event

    def _issue(self, work: Callable[[], None], compute_ready: Any) -> Any:
        if self._cuda_stream is None:
            work()
            return None
        self._cuda_stream.wait_event(compute_ready)
        with torch.cuda.stream(self._cuda_stream):
            work()
        done = torch.cuda.Event()
        done.record(self._cuda_stream)
        return done

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._demand_up_to(self._submitted)
        self._work.put(None)
        self._thread.join()


class SideStream:
    """An ordered queue of device work (copies and collectives) beside the compute stream: a
    worker thread on both devices, issuing on a ``torch.cuda.Stream`` on CUDA. Random ops must
    never run here (DESIGN section 6)."""

    def __init__(self, info: DeviceInfo, name: str = "protrain-side-stream") -> None:
        self.info = info
        cuda_stream = torch.cuda.Stream(device=info.device) if info.is_cuda else None
        self._worker = _OrderedWorker(
            name,
            kind="the side stream",
            threads=torch.get_num_threads(),  # the creating (compute) thread's: copies run at its width
            cuda_stream=cuda_stream,
            device=info.device if info.is_cuda else None,
            # Device work: under the device wall it counts to the engine call that made the stream.
            wall_call=device_wall.current_call(),
        )

    def submit(self, work: Callable[[], None]) -> DeviceEvent:
        """Queue ``work`` after everything submitted before; returns its completion event."""
        return self._worker.submit(work)

    def make_compute_wait(self, event: DeviceEvent) -> None:
        """Make later compute-stream work wait for ``event``: on CUDA the host waits only until
        the job is issued and the compute stream waits on the device; on CPU, where compute runs
        on the host, the host waits for the job."""
        event.wait_issued()
        if event._cuda_event is not None:
            torch.cuda.current_stream(self.info.device).wait_event(event._cuda_event)

    def close(self) -> None:
        self._worker.close()


def used_on_this_stream(*tensors: torch.Tensor) -> None:
    """In a side-stream job: the tensors, allocated on the compute stream, are used by the work
    this job issues. On CUDA, ``record_stream`` keeps the caching allocator from handing their
    memory to new work before that work is done, whenever the compute side lets go of them; host
    tensors, and everything on CPU (where the job itself holds them until it is done), need
    nothing."""
    for tensor in tensors:
        if tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(tensor.device))


class HostWorker:
    """A thread for host arithmetic beside training (the same on both devices): jobs run in
    submission order, on ``threads`` intra-op threads so they do not take the cores compute
    uses; a job that reads what device work wrote waits on that work's event first."""

    def __init__(self, name: str = "protrain-host-worker", *, threads: int = 1, kind: str = "the host worker") -> None:
        self._worker = _OrderedWorker(name, kind=kind, threads=threads)

    def submit(self, work: Callable[[], None]) -> DeviceEvent:
        return self._worker.submit(work)

    def close(self) -> None:
        self._worker.close()


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


def _mallinfo2() -> _MallInfo2:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL("libc.so.6")
        _libc.mallinfo2.restype = _MallInfo2
    return _libc.mallinfo2()


def malloc_in_use_bytes() -> int:
    """Bytes the C heap has handed out (glibc ``mallinfo2``: in-use chunks plus mmapped blocks).

    On CPU this measures the device tier from outside the runtime's own counters: the host tier
    lives in ``MmapArena`` regions, which malloc does not see. Process-wide; compare deltas.
    """
    info = _mallinfo2()
    return int(info.uordblks + info.hblkhd)


def malloc_heap_bytes() -> tuple[int, int]:
    """The C heap's (in-use, held) bytes in one ``mallinfo2`` call (it walks the free lists:
    tens of microseconds): ``malloc_in_use_bytes``, and the arenas plus mmapped blocks it holds
    from the system (freed chunks stay there until trimmed: CUDA's reserved memory on CPU)."""
    info = _mallinfo2()
    return int(info.uordblks + info.hblkhd), int(info.arena + info.hblkhd)


def cuda_reserved_peak_bytes(info: DeviceInfo) -> int:
    """The caching allocator's reserved high-water since its peak statistics were last reset
    (``runtime.hw.memory_counter``'s readings reset them)."""
    return int(torch.cuda.max_memory_reserved(info.device))


def release_free_memory(info: DeviceInfo) -> None:
    """Hand memory freed but still held by the allocator back: the C heap's free pages to the
    OS (glibc ``malloc_trim``), and on CUDA the caching allocator's unused blocks. Called after
    profiling: the steps' activations and gradients are gone, and the chunk state allocated next
    (an mmap arena on CPU, pinned memory on CUDA) cannot reuse the pages glibc would keep."""
    if info.is_cuda:
        torch.cuda.empty_cache()
    trim_host_heap()


def trim_host_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``): glibc keeps freed
    blocks of a few MB in its heap once larger ones were freed, so the resident set would still
    hold memory the process gave up."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def device_allocated_bytes(info: DeviceInfo) -> int:
    """Bytes allocated on the device now: CUDA's allocator statistics; on CPU the engine's count
    under the device wall (runtime/hw/device_wall.py) in an engine call, else the C heap."""
    if info.is_cuda:
        return int(torch.cuda.memory_allocated(info.device))
    account = device_wall.counting_account()
    if account is not None:
        return account.live_bytes
    return malloc_in_use_bytes()


def counts_every_byte(info: DeviceInfo) -> bool:
    """Whether device readings count every tensor on the device, peaks inside operators included
    (CUDA's allocator; the device wall's count on CPU, in an engine call), rather than the C heap
    read at hooks (CPU otherwise, whose readings the callers take relative to a base)."""
    return info.is_cuda or device_wall.counting_account() is not None
