"""Rank 0's run folder and its ``metrics.jsonl``: the folder protrain-run made, or, for a script
not launched by it, a fresh one under the spec's ``output_dir``."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

from protrain.runtime.config.spec_io import ResolvedSpec, SpecError
from protrain.runtime.observability.console import MetricsFile


def open_metrics(resolved: ResolvedSpec, run_dir: Path | None, *, is_main: bool) -> MetricsFile | None:
    """Rank 0's metrics file (None on the other ranks, which write none)."""
    if not is_main:
        return None
    if run_dir is None:
        output_dir = Path(resolved.spec.output_dir).expanduser()
        try:
            run_dir = new_run_dir(output_dir)
        except OSError as err:
            raise SpecError(
                f"output_dir: {output_dir} cannot hold run folders ({err.strerror or err}); give a "
                "directory this user can write (made when missing)"
            ) from None
        (run_dir / "spec.json").write_text(resolved.to_json(), encoding="utf-8")
    return MetricsFile(run_dir / "metrics.jsonl")


def new_run_dir(output_dir: Path) -> Path:
    """A fresh ``{time}-{pid}`` folder: a second engine in the same process and second gets
    its own (``-2``, ...), not a share of the first one's metrics."""
    output_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    for attempt in itertools.count(1):
        run_dir = output_dir / (stem if attempt == 1 else f"{stem}-{attempt}")
        try:
            run_dir.mkdir()
        except FileExistsError:
            continue
        return run_dir
    raise AssertionError("unreachable")
