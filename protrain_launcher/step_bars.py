"""The step time beside the memory picture (``protrain-run --plot``): what metrics.jsonl says
an update took, split into forward, backward, optimizer and the rest, the exposed waits, and the
plan's prediction. Plain Python: the bad-input path of ``--plot`` reads it before matplotlib."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protrain.runtime.commands.plot import Timeline

SPLIT_KEYS = {
    "forward": "time_metrics/forward(s)",
    "backward": "time_metrics/backward(s)",
    "optimizer": "time_metrics/optimizer(s)",
    "other": "time_metrics/other(s)",
}
"""metrics.jsonl's step time split (runtime/observability/update_metrics.py), in the bar's order."""
WAIT_PREFIX = "time_metrics/exposed_wait_"


@dataclass(frozen=True, slots=True)
class StepBars:
    """The right-hand panel's figures, in seconds per update."""

    measured: dict[str, float]
    measured_label: str
    waits: dict[str, float]
    predicted_s: float | None


def step_bars(timeline: Timeline, records: list[dict[str, Any]]) -> StepBars:
    """The step time split: the median over the updates neither traced nor recorded
    (``instrumented_updates``; update 1 too when others exist: it warms up) of metrics.jsonl's
    split, or the recorded update's own spans when the metrics hold no split."""
    steps = [
        r for r in records if "step" in r and not r.get("skipped") and r["step"] not in timeline.instrumented_updates
    ]
    if len(steps) > 1:
        steps = [r for r in steps if r["step"] != 1]
    with_split = [r for r in steps if SPLIT_KEYS["forward"] in r]
    if with_split:
        measured = {part: _median(with_split, key) for part, key in SPLIT_KEYS.items()}
        label = f"measured\n(median of {len(with_split)})"
    else:
        measured = dict.fromkeys(SPLIT_KEYS, 0.0)
        for span in timeline.spans:
            measured["other" if span.phase == "between" else span.phase] += span.end - span.start
        label = f"update {timeline.update}\n(hooks on)"
    waits = {
        key.removeprefix(WAIT_PREFIX).removesuffix("(s)"): _median(steps, key)
        for key in sorted({k for r in steps for k in r if k.startswith(WAIT_PREFIX)})
    }
    if not waits:  # a metrics.jsonl from before the split: each record's waits dict
        flat = [{f"{k.removesuffix('_s')}": v for k, v in r.get("waits", {}).items()} for r in steps]
        waits = {kind: _median(flat, kind) for kind in sorted({k for r in flat for k in r})}
    predicted = timeline.predicted_step_s
    return StepBars(
        measured=measured,
        measured_label=label,
        waits=waits,
        predicted_s=None if predicted is None else predicted * timeline.micro_batches,
    )


def _median(records: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r.get(key, 0.0)) for r in records)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records (none when the file is missing; a torn last line is skipped)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
