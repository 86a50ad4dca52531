"""``protrain-run --plot RUN_DIR``: the memory picture of a run that had ``logging.trace`` set.

    protrain-run --plot RUN_DIR [--rank R] [--out FILE.png]

It reads the run folder's memory timeline (``memory-timeline-rank{R}.json``, written on the update
after the trace window: ``runtime/observability/trace_window.py``) and ``metrics.jsonl``, and draws
them (``memory_picture``) into ``RUN_DIR/memory-rank{R}.png`` unless ``--out`` says where.
Everything is checked before matplotlib (the ``plot`` extra) is imported, and torch never is:
bad input answers at once, with exit 2.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from protrain.launcher.request import EXIT_OK
from protrain.launcher.step_bars import read_metrics, step_bars
from protrain.runtime.commands.plot import read_timeline, timeline_path
from protrain.runtime.config.spec_io import SpecError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise SpecError(f"command line: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="protrain-run --plot",
        description="Draw one update's device, host and SSD bytes through time, with chunk and block "
        "events, the plan's predicted peaks, and the step time split beside the predicted, from a run "
        "folder whose job set logging.trace.",
    )
    parser.add_argument("--plot", dest="run_dir", required=True, metavar="RUN_DIR", help="the run folder")
    parser.add_argument("--rank", type=int, default=0, help="whose timeline (default 0)")
    parser.add_argument("--out", metavar="FILE.png", help="where the PNG goes (default RUN_DIR/memory-rankR.png)")
    return parser


def main(argv: list[str]) -> int:
    """Write the picture; returns 0 (bad input, a missing timeline or matplotlib raise SpecError)."""
    if "-h" in argv or "--help" in argv:
        build_parser().print_help()
        return EXIT_OK
    args = build_parser().parse_args(argv)
    run_dir = Path(args.run_dir).expanduser()
    if not run_dir.is_dir():
        raise SpecError(f"--plot {run_dir}: no such run folder")
    source = timeline_path(run_dir, args.rank)
    if not source.is_file():
        raise SpecError(
            f"{run_dir} holds no memory timeline for rank {args.rank} ({source.name}): run the job with "
            "logging.trace set (e.g. --set logging.trace.start_step=3); the timeline is recorded on the "
            "update right after the trace window, so the run must get that far"
        )
    try:
        timeline = read_timeline(source)
    except ValueError as err:
        raise SpecError(str(err)) from None
    out = Path(args.out).expanduser() if args.out else run_dir / f"memory-rank{args.rank}.png"
    if importlib.util.find_spec("matplotlib") is None:
        raise SpecError("protrain-run --plot needs matplotlib: pip install 'protrain[plot]' (or matplotlib)")
    from protrain.launcher.memory_picture import draw  # imports matplotlib

    draw(timeline, step_bars(timeline, read_metrics(run_dir / "metrics.jsonl")), out)
    print(f"memory picture of update {timeline.update} (rank {timeline.rank}): {out}")
    return EXIT_OK
