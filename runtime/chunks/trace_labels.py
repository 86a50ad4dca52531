"""Profiler labels on the pipeline's jobs: a trace then says which chunk or block each copy, each
piece of host work and each recomputation belongs to.

Every side-stream, host-worker and I/O job that moves, reduces or updates a chunk, or moves or
rebuilds a block's activations, runs inside ``torch.profiler.record_function("protrain.<kind>.<n>")``
(``n`` the chunk, or the block):

- ``gather``: the upload of an offloaded chunk into its device buffer, prefetches included (side
  stream: the copy launch, and the all-gather);
- ``downcast``: an fp32 master downcast into upload staging before its gather (the upload thread);
- ``reduce``: a reduced gradient's copy into host staging, or its add into a persistent shard
  (side stream);
- ``host_add``: the fp32 add of a staged gradient into an offloaded shard, or, where gradients
  are applied as they arrive, its widening to fp32 for CPU Adam (none in fp32) (host worker);
- ``adam``: CPU Adam of an offloaded chunk, early or two-phase (host worker);
- ``norm``: two-phase, an offloaded shard's squared gradient norm (host worker);
- ``swap_out`` / ``swap_in``: a swap block's saved tensor copied to host memory in forward and
  back in backward (the activations' side stream; runtime/activations/transfers.py);
- ``ssd_stage``: on CUDA, an ssd block's saved tensor copied to host staging before its write;
- ``ssd_write`` / ``ssd_read``: an ssd block's activation file written or read (an I/O thread;
  runtime/activations/ssd_store.py);
- ``recompute``: a checkpointed block's forward run again in backward (the thread running
  backward; runtime/activations/checkpointing.py).

A device copy belongs to a chunk when its launch (the CUDA runtime call, by correlation id) lies
inside the label's range on the same thread (``scripts/gpu_checks/trace_overlap.py``). The jobs
run on worker threads, which torch's profiler records only when asked to profile every thread
(``_ExperimentalConfig(profile_all_threads=True)``, torch 2.7 and later). On older torch
``runtime.observability.profiling`` records the labels' ranges itself (``recording``) and merges them
into the trace.

Cost with no profiler running: one ``record_function`` enter and exit and the name, a few
microseconds per job, on the worker threads. The only label on the compute path is a recomputed
block's, once per block, not per operator; so the labels stay on
(docs/decisions/0006-trace-labels-always-on.md).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

PREFIX = "protrain"
CHUNK_KINDS = ("gather", "downcast", "reduce", "host_add", "adam", "norm")
BLOCK_KINDS = ("swap_out", "swap_in", "ssd_stage", "ssd_write", "ssd_read", "recompute")
KINDS = CHUNK_KINDS + BLOCK_KINDS


@dataclass(slots=True)
class RecordedRanges:
    """Label ranges timed here, for a profiler that does not record worker threads: (name,
    native thread id, start ns, end ns) on ``time.time_ns``'s clock, and the threads' names
    (taken while they live). ``list.append`` and a dict store are atomic, so worker threads add
    to them without a lock."""

    ranges: list[tuple[str, int, int, int]] = field(default_factory=list)
    threads: dict[int, str] = field(default_factory=dict)


_recording: RecordedRanges | None = None
"""Set only while a trace on torch < 2.7 runs (``recording``): one global read per label otherwise."""


def job_label(kind: str, index: int) -> contextlib.AbstractContextManager[Any]:
    """The range a profiler shows the job under (a context manager)."""
    name = f"{PREFIX}.{kind}.{index}"
    if _recording is None:
        return torch.profiler.record_function(name)
    return _timed(name, _recording)


@contextlib.contextmanager
def _timed(name: str, recorded: RecordedRanges) -> Iterator[None]:
    start = time.time_ns()
    try:
        with torch.profiler.record_function(name):  # the thread that started the profiler has it too
            yield
    finally:
        tid = threading.get_native_id()
        recorded.ranges.append((name, tid, start, time.time_ns()))
        recorded.threads[tid] = threading.current_thread().name


@contextlib.contextmanager
def recording() -> Iterator[RecordedRanges]:
    """Time every label's range while the block runs (one trace at a time per process)."""
    global _recording
    if _recording is not None:
        raise RuntimeError("label ranges are already being recorded (one trace at a time)")
    _recording = recorded = RecordedRanges()
    try:
        yield recorded
    finally:
        _recording = None
