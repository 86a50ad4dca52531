"""A reusable pool of 2 gloo ranks that runs many test bodies (DESIGN section 6).

Starting processes and a process group costs seconds; the pool pays it once per session. Each
test sends ``(module, function, kwargs)`` to every rank and gets one result per rank. A failure
or a timeout on any rank tears the pool down (a rank may be stuck in a collective) and the next
test starts a fresh one.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

WORLD_SIZE = 2
PROCESS_GROUP_TIMEOUT_S = 60


class RemoteError(AssertionError):
    """A test body failed on a rank; the message carries that rank's traceback."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    while True:
        task = tasks.get()
        if task is None:
            break
        module_name, function_name, kwargs = task
        try:
            function = getattr(importlib.import_module(module_name), function_name)
            _freeze_what_is_alive()
            results.put((rank, True, function(rank=rank, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the test process
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


def _freeze_what_is_alive() -> None:
    """Collect what earlier tasks left, then move every object alive now (torch's, the test
    modules') out of the collector's view: each engine after a process's first runs a full
    collection (runtime/training/live_engines.py), ~0.2 s over torch's objects, every task."""
    for _ in range(3):
        if not gc.collect():
            break
    gc.freeze()


class RankPool:
    def __init__(self, world_size: int = WORLD_SIZE) -> None:
        self.world_size = world_size
        self._context = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None

    def _start(self) -> None:
        port = _free_port()
        self._tasks = [self._context.Queue() for _ in range(self.world_size)]
        self._results = self._context.Queue()
        self._procs = [
            self._context.Process(
                target=_worker,
                args=(rank, self.world_size, port, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()

    def run(self, function: Callable[..., Any], *, timeout_s: float = 120, **kwargs: Any) -> list[Any]:
        """Run ``function(rank=r, **kwargs)`` on every rank; results in rank order."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.shutdown()
            self._start()
        for task_queue in self._tasks:
            task_queue.put((function.__module__, function.__name__, kwargs))
        results: dict[int, Any] = {}
        failures: list[str] = []
        try:
            for _ in range(self.world_size):
                rank, ok, value = self._results.get(timeout=timeout_s)
                if ok:
                    results[rank] = value
                else:
                    failures.append(f"rank {rank}:\n{value}")
                    break
        except queue.Empty:
            missing = sorted(set(range(self.world_size)) - set(results))
            failures.append(f"timed out after {timeout_s}s waiting for ranks {missing}")
        if failures:
            self.shutdown()
            raise RemoteError("\n".join(failures))
        return [results[rank] for rank in range(self.world_size)]

    def shutdown(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        self._procs = []
