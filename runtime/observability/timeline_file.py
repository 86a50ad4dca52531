"""The files ``logging.trace`` leaves in the run folder, and the memory timeline's format.

- ``trace-rank{R}.json.gz``: the Chrome trace (``runtime.observability.profiling``), for Perfetto;
- ``memory-timeline-rank{R}.json``: one update's memory timeline (``runtime.observability.memory_timeline``),
  which ``protrain-run --plot`` draws.

The timeline is plain JSON: samples ``[t, device_bytes, host_bytes, ssd_bytes, phase]``, marks
``[t, kind, index]`` and spans ``[phase, start, end]``, seconds from the update's first forward.
This module imports no torch: the launcher reads it to draw the picture.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = 1

SAMPLE_PHASES = ("start", "forward", "backward", "recompute", "end")
"""Where a sample was taken: the update's first forward, after a module's forward, after a
parameter's gradient was accumulated, after a module's forward run again in backward (a
checkpointed block's recomputation), after the update."""
MARK_KINDS = ("gather", "evict", "block_forward", "block_backward")
"""A chunk's upload started (a prefetch too) or its buffer let go; a block's forward or backward began."""
SPAN_PHASES = ("forward", "backward", "optimizer", "between")
"""The model's forward, its backward (from the forward's end to the last gradient), the update
after the window's last gradient, and what lies between micro-batches (the training loop)."""


def trace_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"trace-rank{rank}.json.gz"


def timeline_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"memory-timeline-rank{rank}.json"


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    device_bytes: int
    """On CUDA the allocator's peak since the previous sample; on CPU the C heap in use."""
    host_bytes: int
    """The host arenas: chunk state (fp32 masters, Adam moments, offloaded shards) and swapped activations."""
    ssd_bytes: int
    """Activation files on disk."""
    phase: str


@dataclass(frozen=True, slots=True)
class Mark:
    t: float
    kind: str
    index: int
    """The chunk (gather, evict) or the block (block_forward, block_backward)."""


@dataclass(frozen=True, slots=True)
class Span:
    phase: str
    start: float
    end: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    """One update's memory through time on one rank, and the plan's predictions beside it."""

    update: int
    rank: int
    device: str
    device_reading: str
    """What ``Sample.device_bytes`` is, in words (it differs between CUDA and CPU)."""
    samples: tuple[Sample, ...]
    marks: tuple[Mark, ...]
    spans: tuple[Span, ...]
    duration_s: float
    micro_batches: int
    predicted_step_s: float | None
    """The plan's, per micro-batch (an update predicts ``micro_batches`` times it)."""
    predicted_peak_device_bytes: int | None
    predicted_peak_host_bytes: int | None
    device_budget_bytes: int
    host_budget_bytes: int
    instrumented_updates: tuple[int, ...]
    """Updates the trace or this recording slowed down: step times are read from the others."""

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "update": self.update,
            "rank": self.rank,
            "device": self.device,
            "device_reading": self.device_reading,
            "duration_s": self.duration_s,
            "micro_batches": self.micro_batches,
            "predicted_step_s": self.predicted_step_s,
            "predicted_peak_device_bytes": self.predicted_peak_device_bytes,
            "predicted_peak_host_bytes": self.predicted_peak_host_bytes,
            "device_budget_bytes": self.device_budget_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "instrumented_updates": list(self.instrumented_updates),
            "samples": [[round(s.t, 7), s.device_bytes, s.host_bytes, s.ssd_bytes, s.phase] for s in self.samples],
            "marks": [[round(m.t, 7), m.kind, m.index] for m in self.marks],
            "spans": [[s.phase, round(s.start, 7), round(s.end, 7)] for s in self.spans],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Timeline:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"memory timeline schema {data.get('schema')!r}; this version reads {SCHEMA}")
        return cls(
            update=int(data["update"]),
            rank=int(data["rank"]),
            device=str(data["device"]),
            device_reading=str(data["device_reading"]),
            duration_s=float(data["duration_s"]),
            micro_batches=int(data["micro_batches"]),
            predicted_step_s=data["predicted_step_s"],
            predicted_peak_device_bytes=data["predicted_peak_device_bytes"],
            predicted_peak_host_bytes=data["predicted_peak_host_bytes"],
            device_budget_bytes=int(data["device_budget_bytes"]),
            host_budget_bytes=int(data["host_budget_bytes"]),
            instrumented_updates=tuple(int(u) for u in data["instrumented_updates"]),
            samples=tuple(Sample(float(t), int(d), int(h), int(s), str(p)) for t, d, h, s, p in data["samples"]),
            marks=tuple(Mark(float(t), str(k), int(i)) for t, k, i in data["marks"]),
            spans=tuple(Span(str(p), float(a), float(b)) for p, a, b in data["spans"]),
        )


def write_timeline(path: Path, timeline: Timeline) -> None:
    """Written whole then renamed: a reader never sees half a file."""
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(timeline.to_json(), separators=(",", ":")), encoding="utf-8")
    partial.replace(path)


def read_timeline(path: Path) -> Timeline:
    """The timeline in ``path``; ValueError naming the file when it is not one."""
    try:
        return Timeline.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: not a memory timeline this version can read ({err})") from None
