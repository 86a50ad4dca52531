"""The CPU stand-in of the device layer: ordered side stream, events, mmap arena, mallinfo2."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch

from protrain.runtime.hw.device import DeviceInfo, HostWorker, SideStream, host_worker_threads, malloc_in_use_bytes
from protrain.runtime.hw.host_memory import PAGE_BYTES, MmapArena

CPU = DeviceInfo(torch.device("cpu"), "gloo")


def test_side_stream_runs_in_submission_order_off_the_caller_thread() -> None:
    stream = SideStream(CPU)
    seen: list[tuple[int, str]] = []
    gate = threading.Event()
    first = stream.submit(lambda: (gate.wait(5), seen.append((0, threading.current_thread().name))))
    second = stream.submit(lambda: seen.append((1, threading.current_thread().name)))
    assert not first.query() and not second.query()  # held back by the gate: asynchronous
    gate.set()
    second.wait()
    assert first.query()
    assert [i for i, _ in seen] == [0, 1]
    assert all(name == "protrain-side-stream" for _, name in seen)
    stream.close()


def test_side_stream_copies_overlap_with_the_caller() -> None:
    stream = SideStream(CPU)
    source = torch.arange(1_000_000, dtype=torch.float32)
    target = torch.empty_like(source)
    event = stream.submit(lambda: (time.sleep(0.05), target.copy_(source)))
    started = time.perf_counter()
    stream.make_compute_wait(event)
    assert time.perf_counter() - started > 0.01
    assert torch.equal(target, source)
    stream.close()


def test_failure_on_the_stream_is_raised_to_the_waiter() -> None:
    stream = SideStream(CPU)

    def fail() -> None:
        raise OSError("disk on fire")

    event = stream.submit(fail)
    with pytest.raises(RuntimeError, match="side stream failed") as info:
        event.wait()
    assert isinstance(info.value.__cause__, OSError)
    # Like a CUDA error, the failure sticks: later work does not run (it may depend on what
    # failed) and its event reports the failure, so waiting for the last event cannot miss it.
    ran: list[int] = []
    later = stream.submit(lambda: ran.append(1))
    with pytest.raises(RuntimeError, match="side stream failed") as info:
        later.wait()
    assert isinstance(info.value.__cause__, OSError) and ran == []
    stream.close()
    with pytest.raises(RuntimeError, match="closed"):
        stream.submit(lambda: None)


def test_arena_is_exact_page_aligned_and_invisible_to_malloc() -> None:
    arena = MmapArena(64 << 20)
    before = malloc_in_use_bytes()
    a = arena.allocate(1000, torch.float32)
    b = arena.allocate(10, torch.bfloat16)
    big = arena.allocate(8 << 20, torch.float32)
    big.fill_(1.0)
    assert malloc_in_use_bytes() - before < 1 << 20
    assert (a.numel(), a.dtype, b.numel(), b.dtype) == (1000, torch.float32, 10, torch.bfloat16)
    assert a.data_ptr() % PAGE_BYTES == 0 and b.data_ptr() % PAGE_BYTES == 0
    assert torch.count_nonzero(a) == 0  # fresh pages are zeroed
    assert arena.contains(big) and not arena.contains(torch.empty(4))
    with pytest.raises(MemoryError, match="host arena full"):
        arena.allocate(64 << 20, torch.float32)
    arena.close()


def test_arena_packs_at_its_alignment_and_owns_an_empty_tensor_at_its_end() -> None:
    """Chunk state asks for a cache line, not a page; a rank holding none of a chunk's elements
    gets an empty tensor (whose data_ptr torch reports as 0), still the arena's: counted there,
    not as device memory."""
    arena = MmapArena(4096, alignment=64)
    a = arena.allocate(3, torch.float32)
    b = arena.allocate(1, torch.float32)
    assert b.data_ptr() - a.data_ptr() == 64
    rest = arena.allocate((4096 - 128) // 4, torch.float32)
    empty = arena.allocate(0, torch.float32)
    assert rest.data_ptr() + rest.nbytes == a.data_ptr() + arena.capacity_bytes
    assert empty.numel() == 0 and arena.contains(empty) and arena.contains(rest)
    assert not arena.contains(torch.empty(0))
    arena.close()


def test_malloc_counter_sees_ordinary_tensors() -> None:
    before = malloc_in_use_bytes()
    tensor = torch.ones(4 << 20)  # 16 MiB from the C heap
    grown = malloc_in_use_bytes() - before
    assert grown >= tensor.numel() * 4
    del tensor


def test_freed_heap_pages_go_back_to_the_os() -> None:
    """What profiling leaves behind (many small freed tensors) stops counting in the process's
    resident set once released, so the chunk state allocated next does not add up on top."""
    from protrain.runtime.hw.device import release_free_memory

    def resident_mib() -> float:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmRSS"))
        return int(line.split()[1]) / 1024

    # 64 KiB each: below glibc's mmap threshold, so they live in the heap and stay there freed.
    kept = [torch.ones(16 * 1024) for _ in range(3200)]
    keep_last = kept[-1]  # a live block at the top of the heap: freeing alone cannot shrink it
    del kept
    before = resident_mib()
    release_free_memory(DeviceInfo(torch.device("cpu"), "gloo"))
    assert before - resident_mib() > 100, "about 200 MiB of freed heap should be returned"
    assert float(keep_last.sum()) == 16 * 1024


def test_the_host_worker_takes_one_core_on_cpu_and_the_free_cores_beside_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CPU, backward computes on the cores the host worker would take; beside a GPU they are
    free but for the main and side-stream threads, shared among this node's ranks."""
    cpu = DeviceInfo(torch.device("cpu"), "gloo")
    gpu = DeviceInfo(torch.device("cuda", 0), "nccl")  # only its kind is read: no GPU needed
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert host_worker_threads(cpu) == 1
    assert host_worker_threads(gpu) == 14
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_worker_threads(gpu) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert host_worker_threads(gpu) == 1


def test_each_worker_keeps_its_own_thread_count_whatever_the_other_set() -> None:
    """torch gives a thread its count at its first parallel op from the process value the last
    set_num_threads left: the side stream's copies must keep the compute thread's width even
    when the host worker (one thread) was made just before or after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # also under CI's one-thread workers: a width the host worker's is not
    try:
        _check_worker_threads(compute_threads=2)
    finally:
        torch.set_num_threads(before)


def _check_worker_threads(*, compute_threads: int) -> None:
    for host_first in (True, False):
        host = HostWorker("test-host", threads=1) if host_first else None
        side = SideStream(DeviceInfo(torch.device("cpu"), "gloo"), name="test-side")
        if host is None:
            host = HostWorker("test-host", threads=1)
        seen: dict[str, int] = {}

        def measure(key: str) -> None:
            torch.ones(1 << 16).add_(1.0)  # a parallel op: torch's lazy initialisation has run
            seen[key] = torch.get_num_threads()

        side.submit(lambda: measure("side")).wait()
        host.submit(lambda: measure("host")).wait()
        side.close()
        host.close()
        assert seen == {"side": compute_threads, "host": 1}, (host_first, seen)


def test_a_host_that_refuses_to_page_lock_a_region_gets_torchs_pinned_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Some virtualised hosts refuse ``cudaHostRegister``: the region then comes from torch's
    pinned host allocator (here a plain tensor stands in for it), counted at the power of two
    that allocator rounds it to, with one warning per error code (before: a RuntimeError, and
    no run on such a host)."""
    import protrain.runtime.hw.host_memory as host_memory

    class RefusingCudart:
        last_error = 0

        def cudaHostRegister(self, *_: object) -> int:  # noqa: N802 - CUDA's name
            self.last_error = 801  # cudaErrorNotSupported: any refusal
            return self.last_error

        def cudaGetLastError(self) -> int:  # noqa: N802
            error, self.last_error = self.last_error, 0
            return error

    cudart = RefusingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(host_memory, "_cuda_runtime", lambda: cudart)
    monkeypatch.setattr(host_memory, "pinned_bytes", lambda n: torch.zeros(n, dtype=torch.uint8))
    monkeypatch.setattr(host_memory, "_register_refusals", set())
    before = host_memory.host_arena_bytes()
    with pytest.warns(RuntimeWarning, match="cudaHostRegister refused"):
        arena = MmapArena(3 * PAGE_BYTES, pin=True)
    tensor = arena.allocate(PAGE_BYTES // 4, torch.float32)
    tensor.fill_(2.0)
    assert arena.contains(tensor) and float(tensor.sum()) == 2.0 * (PAGE_BYTES // 4)
    held, pinned = host_memory.host_arena_bytes()
    assert (held - before[0], pinned - before[1]) == (4 * PAGE_BYTES, 4 * PAGE_BYTES)
    # CUDA keeps a refusal as the thread's last error, which torch's next kernel launch would
    # raise as its own failure (seen on an H100): it is read off.
    assert cudart.last_error == 0
    arena.give_back(tensor)  # a pinned block cannot be returned a page at a time: nothing happens
    arena.close()
    arena.close()
    assert host_memory.host_arena_bytes() == before


class RegistrationTable:
    """CUDA's table of page-locked host ranges, as the driver keeps it: a range overlapping a
    registered one is refused with error 712 (cudaErrorHostMemoryAlreadyRegistered), which also
    becomes the thread's last error."""

    def __init__(self) -> None:
        self.ranges: dict[int, int] = {}
        self.last_error = 0

    def cudaHostRegister(self, address: int, nbytes: int, _flags: int) -> int:  # noqa: N802 - CUDA's name
        if any(address < start + size and start < address + nbytes for start, size in self.ranges.items()):
            self.last_error = 712
            return 712
        self.ranges[address] = nbytes
        return 0

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        if self.ranges.pop(address, None) is None:
            self.last_error = 713  # cudaErrorHostMemoryNotRegistered
            return 713
        return 0

    def cudaGetLastError(self) -> int:  # noqa: N802
        error, self.last_error = self.last_error, 0
        return error


def test_a_dropped_or_unpinned_region_leaves_nothing_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A region dropped without ``close()`` (its engine dropped) is unregistered before its mmap
    goes: else the kernel hands the same addresses to the next region and CUDA refuses them
    (an H100 run's fourth engine in one process failed so). ``unpin()`` (a closed engine's host
    state, which stays readable) unregisters at once, and only once."""
    import protrain.runtime.hw.host_memory as host_memory

    table = RegistrationTable()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: table)
    monkeypatch.setattr(host_memory, "_cuda_runtime", lambda: table)
    for _ in range(3):  # dropped, never closed: each next one may land on the same addresses
        arena = MmapArena(64 * PAGE_BYTES, pin=True)
        arena.allocate(PAGE_BYTES, torch.uint8).fill_(1)
        assert len(table.ranges) == 1 and table.last_error == 0
        del arena
        gc.collect()
        assert table.ranges == {}
    arena = MmapArena(64 * PAGE_BYTES, pin=True)
    kept = arena.allocate(PAGE_BYTES, torch.float32)
    arena.unpin()
    assert table.ranges == {} and host_memory.host_arena_bytes()[1] == 0
    kept.fill_(3.0)  # still mapped and readable
    assert float(kept[0]) == 3.0
    arena.unpin()
    arena.close()
    assert table.last_error == 0, "unregistered twice"


def test_cudas_sanitizer_sees_the_worker_threads_operators(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch enters its sanitizer's dispatch mode on the importing thread only (mode stacks are
    per thread): the side stream's and the host worker's operators went unseen. Each worker now
    hands its operators to the one sanitizer mode (a recording stand-in here)."""
    import sys
    from types import ModuleType, SimpleNamespace

    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[tuple[str, str]] = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append((threading.current_thread().name, str(func)))
            return func(*args, **(kwargs or {}))

    fake = ModuleType("torch.cuda._sanitizer")
    fake.cuda_sanitizer = SimpleNamespace(enabled=True, dispatch=Recording())  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.cuda._sanitizer", fake)
    stream = SideStream(DeviceInfo(torch.device("cpu"), "gloo"), name="test-sanitized-stream")
    worker = HostWorker("test-sanitized-worker")
    try:
        source = torch.ones(8)
        stream.submit(lambda: torch.empty(8).copy_(source)).wait()
        worker.submit(lambda: source.add(1.0)).wait()
    finally:
        stream.close()
        worker.close()
    threads = {thread for thread, _ in seen}
    assert {"test-sanitized-stream", "test-sanitized-worker"} <= threads, seen
    assert any("copy_" in op for thread, op in seen if thread == "test-sanitized-stream")
