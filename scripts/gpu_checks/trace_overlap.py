"""Overlap read from a profiler trace: how much of the pipeline's transfer and host work ran while
the device computed, per chunk and in all, independently of the runtime's own bookkeeping.

The input is the Chrome trace ``torch.profiler`` exports (``{"traceEvents": [...]}``, times in
microseconds), taken with every thread profiled, so that the runtime's job labels
(``runtime/chunks/trace_labels.py``: ``protrain.<kind>.<chunk>``) on its worker threads are in it.

- compute: on CUDA the kernels of the compute stream (the stream with the most kernel time: the
  side stream issues copies only); on CPU the main thread's operators, where forward and
  backward run there.
- transfers (``gather``, ``reduce``): on CUDA the device copies (``gpu_memcpy``) whose launch lies
  inside such a label on the thread that made it (the copy's correlation id names the CUDA
  runtime call, whose "External id" names the operator that made it); on CPU, which has no
  device copies, the labels' own ranges on the side-stream thread (they include a wait for a
  free staging buffer, so CPU figures run high).
- host work (``host_add``, ``adam``, ``norm``): the labels' ranges off the main thread (the
  host worker's; a label on the main thread is a persistent chunk's update, compute itself).

hidden share = |work ∩ compute| / |work|, where |.| measures a union of intervals (time two
overlapping jobs share counts once). The same functions serve the CPU rehearsal and the GPU run;
only the two selections above differ by device.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Interval = tuple[float, float]
"""(start, end) in microseconds."""

TRANSFER_KINDS = ("gather", "reduce")
HOST_KINDS = ("host_add", "adam", "norm")
LABEL = re.compile(r"^protrain\.(\w+)\.(\d+)$")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


# --------------------------------------------------------------------------- interval algebra


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the same time."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def measure(merged: Sequence[Interval]) -> float:
    return sum(end - start for start, end in merged)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The common time of two unions (each sorted and disjoint)."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


@dataclass(frozen=True, slots=True)
class Share:
    busy_s: float
    hidden_s: float

    @property
    def fraction(self) -> float | None:
        """Hidden share of the busy time; None when there was no such work."""
        return self.hidden_s / self.busy_s if self.busy_s > 0 else None


def share(work: Iterable[Interval], compute: Sequence[Interval]) -> Share:
    merged = union(work)
    return Share(busy_s=measure(merged) * 1e-6, hidden_s=measure(intersect(merged, compute)) * 1e-6)


# --------------------------------------------------------------------------- reading a trace


@dataclass(frozen=True, slots=True)
class TraceParts:
    """What a trace says about the pipeline: compute time and each chunk's work."""

    compute: list[Interval]
    """The union of compute intervals."""
    compute_source: str
    """Where compute was read from (a stream, or the main thread), for the report."""
    work: dict[tuple[str, int], list[Interval]]
    """(kind, chunk) -> the intervals of that work."""
    unlabelled_copy_s: float = 0.0
    """Device copies no label claims (the batch's upload, the loss read back), seconds."""
    labels: int = 0
    """Job labels in the trace (on CUDA, a transfer label claims work only through its copies)."""


def _events(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def _category(event: Mapping[str, Any]) -> str:
    return str(event.get("cat", "")).lower()


def _span(event: Mapping[str, Any]) -> Interval:
    start = float(event["ts"])
    return start, start + float(event["dur"])


def _labels(events: Iterable[Mapping[str, Any]]) -> list[tuple[str, int, Any, Interval]]:
    """(kind, chunk, thread, range) of every job label on a CPU thread."""
    found = []
    for event in events:
        if _category(event) != "user_annotation":
            continue
        match = LABEL.match(str(event.get("name", "")))
        if match:
            found.append((match.group(1), int(match.group(2)), event.get("tid"), _span(event)))
    return found


def parse_trace(trace: Mapping[str, Any], *, cuda: bool, main_tid: int) -> TraceParts:
    """Compute, transfer and host intervals of a trace (see the module docstring)."""
    events = _events(trace)
    labels = _labels(events)
    work: dict[tuple[str, int], list[Interval]] = defaultdict(list)
    for kind, chunk, tid, span in labels:
        if kind in HOST_KINDS and tid != main_tid:
            work[(kind, chunk)].append(span)
    if not cuda:
        for kind, chunk, _tid, span in labels:
            if kind in TRANSFER_KINDS:
                work[(kind, chunk)].append(span)
        compute = [_span(e) for e in events if _category(e) == "cpu_op" and e.get("tid") == main_tid]
        source = f"main thread {main_tid}"
        return TraceParts(compute=union(compute), compute_source=source, work=dict(work), labels=len(labels))
    stream_time: dict[Any, float] = defaultdict(float)
    for event in events:
        if _category(event) == "kernel":
            stream_time[_stream(event)] += float(event["dur"])
    if not stream_time:
        raise ValueError("the trace holds no CUDA kernels: was it taken with ProfilerActivity.CUDA?")
    compute_stream = max(stream_time, key=lambda s: stream_time[s])
    compute = [_span(e) for e in events if _category(e) == "kernel" and _stream(e) == compute_stream]
    index = LabelIndex([label for label in labels if label[0] in TRANSFER_KINDS])
    unlabelled = 0.0
    for copy, launch_tid, launch_ts in _copies_with_launches(events):
        owner = index.at(launch_tid, launch_ts)
        if owner is None:
            unlabelled += copy[1] - copy[0]
        else:
            work[owner].append(copy)
    return TraceParts(
        compute=union(compute),
        compute_source=f"CUDA stream {compute_stream}",
        work=dict(work),
        unlabelled_copy_s=unlabelled * 1e-6,
        labels=len(labels),
    )


def _stream(event: Mapping[str, Any]) -> Any:
    args = event.get("args") or {}
    return args.get("stream", event.get("tid"))


def _copies_with_launches(events: Sequence[Mapping[str, Any]]) -> list[tuple[Interval, Any, float]]:
    """Each device copy with the thread and time it was launched from: the operator (or label)
    open when the CUDA runtime call was made (linked by the call's "External id"), or else the
    call itself (the operator's thread id is the profiler's own, as the labels' are; a runtime
    call's comes from CUPTI). A copy whose launch is not in the trace gets no thread."""
    operators = {}
    for event in events:
        if _category(event) in ("cpu_op", "user_annotation"):
            external = (event.get("args") or {}).get("External id")
            if external is not None:
                operators[external] = (event.get("tid"), float(event["ts"]))
    launches = {}
    for event in events:
        if _category(event) in LAUNCH_CATEGORIES:
            args = event.get("args") or {}
            if args.get("correlation") is not None:
                site = operators.get(args.get("External id"), (event.get("tid"), float(event["ts"])))
                launches[args["correlation"]] = site
    copies = []
    for event in events:
        if _category(event) == "gpu_memcpy":
            tid, ts = launches.get((event.get("args") or {}).get("correlation"), (None, 0.0))
            copies.append((_span(event), tid, ts))
    return copies


class LabelIndex:
    """Which label holds a given instant on a given thread (labels of one thread never nest)."""

    def __init__(self, labels: Iterable[tuple[str, int, Any, Interval]]) -> None:
        by_thread: dict[Any, list[tuple[Interval, str, int]]] = defaultdict(list)
        for kind, chunk, tid, span in labels:
            by_thread[tid].append((span, kind, chunk))
        self._spans = {tid: sorted(entries) for tid, entries in by_thread.items()}
        self._starts = {tid: [span[0] for span, _, _ in entries] for tid, entries in self._spans.items()}

    def at(self, tid: Any, ts: float) -> tuple[str, int] | None:
        """The (kind, chunk) of the label on thread ``tid`` whose range holds ``ts``."""
        starts = self._starts.get(tid)
        if not starts:
            return None
        index = bisect.bisect_right(starts, ts) - 1
        if index < 0:
            return None
        (start, end), kind, chunk = self._spans[tid][index]
        return (kind, chunk) if start <= ts <= end else None


# --------------------------------------------------------------------------- the shares


@dataclass(frozen=True, slots=True)
class Overlap:
    compute_s: float
    transfers: Share
    host: Share
    all_work: Share
    per_kind: dict[str, Share]
    per_chunk: dict[int, dict[str, Share]]
    """chunk -> kind -> its share."""


def overlap(parts: TraceParts) -> Overlap:
    """Hidden shares of the transfers, the host work and both, by kind and by chunk."""
    compute = parts.compute

    def of(kinds: Iterable[str]) -> list[Interval]:
        wanted = set(kinds)
        return [span for (kind, _), spans in parts.work.items() if kind in wanted for span in spans]

    per_chunk: dict[int, dict[str, Share]] = defaultdict(dict)
    for (kind, chunk), spans in sorted(parts.work.items()):
        per_chunk[chunk][kind] = share(spans, compute)
    kinds = sorted({kind for kind, _ in parts.work})
    return Overlap(
        compute_s=measure(compute) * 1e-6,
        transfers=share(of(TRANSFER_KINDS), compute),
        host=share(of(HOST_KINDS), compute),
        all_work=share(of((*TRANSFER_KINDS, *HOST_KINDS)), compute),
        per_kind={kind: share(of((kind,)), compute) for kind in kinds},
        per_chunk=dict(per_chunk),
    )
