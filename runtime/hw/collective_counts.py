"""How many collectives of each kind an engine's process group issued, and their bytes: what a
step costs in communication, beside its time (metrics.jsonl's ``collectives/*``).

Counted where ProTrain issues them (runtime/hw/distributed.py), as the logical collective the
caller asked for: gloo's all-gather runs as one broadcast per rank and its reduce-scatter as one
reduce per rank, and each still counts once, at the bytes the collective's definition moves (an
all-gather's output, a reduce-scatter's input, an all-reduce's tensor). Each engine has its own
group, so two engines of a process count apart; ``take`` reads a group's counts and starts them
over.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")

_lock = threading.Lock()
_counts: dict[int, dict[str, list[int]]] = {}
"""Per group (by identity; None is the default group): per kind, [calls, bytes]."""


def count(group: dist.ProcessGroup | None, kind: str, nbytes: int) -> None:
    """One collective of ``kind`` over ``group``, moving ``nbytes`` by its definition."""
    with _lock:
        tally = _counts.setdefault(id(group), {})
        calls_bytes = tally.setdefault(kind, [0, 0])
        calls_bytes[0] += 1
        calls_bytes[1] += nbytes


def take(group: dist.ProcessGroup | None) -> dict[str, tuple[int, int]]:
    """(calls, bytes) per kind issued over ``group`` since the last ``take``; then zero."""
    with _lock:
        tally = _counts.pop(id(group), {})
    return {kind: (calls, nbytes) for kind, (calls, nbytes) in tally.items()}
