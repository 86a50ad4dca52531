"""Profiler labels on the pipeline's jobs: a trace then says which chunk each copy and each piece
of host work belongs to.

Every side-stream and host-worker job that moves, reduces or updates a chunk runs inside
``torch.profiler.record_function("protrain.<kind>.<chunk>")``:

- ``gather``: the upload of an offloaded chunk into its device buffer (side stream; on CUDA the
  fp32 master's downcast into staging, then the copy launch);
- ``reduce``: a reduced gradient's copy into host staging, or its add into a persistent shard
  (side stream);
- ``host_add``: the fp32 add of a staged gradient into an offloaded shard (host worker);
- ``adam``: CPU Adam of an offloaded chunk, early or two-phase (host worker);
- ``norm``: two-phase, an offloaded shard's squared gradient norm (host worker).

A device copy belongs to a chunk when its launch (the CUDA runtime call, by correlation id) lies
inside the label's range on the same thread (``scripts/gpu_checks/trace_overlap.py``). The jobs
run on worker threads, which torch's profiler records only when asked to profile every thread
(``_ExperimentalConfig(profile_all_threads=True)``, torch 2.7 and later).

Cost with no profiler running: one ``record_function`` enter and exit, 5.7 microseconds per job
on the worker thread, not the main one (measured on the 2-core CPU machine, torch 2.13, best of
5 x 200,000); a micro-batch has about four jobs per offloaded chunk.
"""

from __future__ import annotations

import torch

PREFIX = "protrain"
KINDS = ("gather", "reduce", "host_add", "adam", "norm")


def job_label(kind: str, chunk: int) -> torch.profiler.record_function:
    """The range a profiler shows the job under (a context manager)."""
    return torch.profiler.record_function(f"{PREFIX}.{kind}.{chunk}")
