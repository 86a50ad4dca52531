"""Host arithmetic rates for the cost model: the host worker's copies, downcasts and gradient adds,
measured at its thread count, alone and beside a CPU Adam on the other cores.

The host worker does this work in host memory, whatever the device: on a GPU machine its rates
are the host's (tens of GB/s), not the device's copy rate (HBM, TB/s), at which those terms
came out far too small (docs/decisions/0012-host-work-at-host-rates.md). The ranks of a node share its
memory and each runs its CPU Adam while the others add and downcast, so the share that is left
beside an Adam is measured too (``HardwareProfile.host_shared_factor``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from protrain.runtime.chunks.grad_add import add_widened
from protrain.runtime.hw import device_wall
from protrain.runtime.optim.adamw import ShardAdamW

HOST_PROBE_NUMEL = 4 << 20
"""Elements per probe (16 MiB in fp32): beyond the caches, as chunk shards are."""
ADAM_BESIDE_NUMEL = 2 << 20
HALF = torch.bfloat16
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class HostRates:
    copy_bytes_per_s: float
    """fp32 bytes copied per second."""
    downcast_bytes_per_s: float
    """fp32 read plus 16-bit written, bytes per second."""
    add_bytes_per_s: float
    """16-bit read, fp32 read and written, bytes per second (widened, then added)."""
    shared_factor: float
    """The smallest share of the three rates left beside a CPU Adam on the other cores."""


def measure_host_rates(threads: int, *, numel: int = HOST_PROBE_NUMEL) -> HostRates:
    """The rates on a thread of ``threads`` intra-op threads (as the host worker runs), alone,
    then with a CPU Adam stepping on the machine's other cores."""
    return on_thread(threads, lambda: _measure(threads, numel))


def on_thread(threads: int, work: Callable[[], T]) -> T:
    """``work()`` on a fresh thread with ``threads`` intra-op threads (torch keeps the number per
    thread: the caller's stays); its error is raised here."""
    result: list[T] = []
    errors: list[BaseException] = []

    def body() -> None:
        torch.set_num_threads(threads)
        try:
            result.append(work())
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            errors.append(error)

    thread = threading.Thread(target=body, name="protrain-probe")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def _measure(threads: int, numel: int) -> HostRates:
    with device_wall.host_allocations():
        source = torch.ones(numel, dtype=torch.float32)
        target = torch.empty_like(source)
        half = torch.ones(numel, dtype=HALF)
        scratch = torch.empty(min(numel, 1 << 20), dtype=torch.float32)
    probes: list[tuple[Callable[[], object], int]] = [
        (lambda: target.copy_(source), 4 * numel),
        (lambda: half.copy_(source), 6 * numel),
        (lambda: add_widened(target, half, scratch), 10 * numel),
    ]
    alone = [nbytes / best_time(work) for work, nbytes in probes]
    with _AdamBeside(max(1, (os.cpu_count() or 1) - threads)):
        beside = [nbytes / best_time(work) for work, nbytes in probes]
    shared = min(1.0, *(b / a for a, b in zip(alone, beside, strict=True)))
    copy, downcast, add = alone
    return HostRates(copy, downcast, add, shared_factor=shared)


class _AdamBeside:
    """A CPU Adam stepping on ``threads`` threads of its own until the block ends."""

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="protrain-probe-adam", daemon=True)

    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        with device_wall.host_allocations():
            master = torch.zeros(ADAM_BESIDE_NUMEL, dtype=torch.float32)
            grad = torch.full_like(master, 1e-3)
        adam = ShardAdamW(master, [(0, master.numel(), 0.0)], lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
        adam.step_(grad, [True])
        self._started.set()
        while not self._stop.is_set():
            adam.step_(grad, [True])

    def __enter__(self) -> None:
        self._thread.start()
        self._started.wait()

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def best_time(work: Callable[[], object], repeats: int = 3) -> float:
    """The shortest of ``repeats`` runs of ``work`` after a warm-up (first-touch page faults)."""
    work()  # first-touch page faults
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return max(best, 1e-9)
