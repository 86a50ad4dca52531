"""``protrain-run --report``: the environment report a bug report attaches (like DeepSpeed's
``ds_report``), as tables or as JSON.

    protrain-run --report [--config job.yaml] [--set KEY.PATH=VALUE] [--ssd-path DIR]
                          [--ssd-probe-size 64MiB] [--json]

This module reads the arguments and renders; the probes are ``runtime/commands/env_report/``. The spec,
when given, says where the profile cache is (``profiler.cache_dir``) and which disk the job
would use (``memory.ssd.path``, measured only when ``--ssd-path`` names it: the probe writes).
Exit 0 whatever the probes find; 2 for bad input (an unreadable spec, a bad option).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from protrain.launcher.request import EXIT_OK
from protrain.runtime.commands.env_report import (
    ReportOptions,
    Section,
    Status,
    collect_report,
    parse_probe_size,
    report_json,
)
from protrain.runtime.config.spec_io import SpecError, load_spec, parse_override

STATUS_STYLE = {Status.OK: "", Status.NOTE: "yellow", Status.FAILED: "red"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise SpecError(f"command line: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="protrain-run",
        description="Print what a bug report needs: versions, GPUs, CPU, host memory and its limits, "
        "the disk under --ssd-path, the profile cache, the relevant environment variables.",
    )
    parser.add_argument("--report", action="store_true", required=True, help="this report")
    parser.add_argument("--config", metavar="FILE", help="job spec: its profiler.cache_dir and memory.ssd.path")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY.PATH=VALUE")
    parser.add_argument("--ssd-path", metavar="DIR", help="measure O_DIRECT and write/read rates here")
    parser.add_argument(
        "--ssd-probe-size", default="64MiB", metavar="SIZE", help="bytes the disk probe writes and reads"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (for a bug report) instead of tables")
    return parser


def report_options(argv: list[str]) -> tuple[ReportOptions, bool]:
    """The options ``argv`` asks for, and whether to print JSON; SpecError for bad input."""
    args = build_parser().parse_args(argv)
    spec = load_spec(args.config, [parse_override(text) for text in args.sets])
    options = ReportOptions(
        cache_dir=Path(spec.profiler.cache_dir).expanduser(),
        cache_source=args.config or "the default",
        ssd_path=Path(args.ssd_path) if args.ssd_path else None,
        ssd_probe_bytes=parse_probe_size(args.ssd_probe_size),
        spec_ssd_path=spec.memory.ssd.path,
    )
    return options, bool(args.json)


def main(argv: list[str]) -> int:
    """Collect and print the report; returns 0 (bad input raises SpecError)."""
    if "-h" in argv or "--help" in argv:
        build_parser().print_help()
        return EXIT_OK
    options, as_json = report_options(argv)
    sections = collect_report(options)
    if as_json:
        print(json.dumps(report_json(sections), indent=1, default=str))
        return EXIT_OK
    console = Console(highlight=False)
    for section in sections:
        console.print(section_table(section))
    failed = sum(row.status is Status.FAILED for section in sections for row in section.rows)
    if failed:
        console.print(f"[red]{failed} probe(s) failed[/red]; their rows say why")
    return EXIT_OK


def section_table(section: Section) -> Table:
    table = Table(title=section.title, title_justify="left", show_header=False, expand=False)
    table.add_column("item", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    for row in section.rows:
        # Text, not markup: values hold brackets (CPU lists, paths) that rich would read as tags.
        table.add_row(Text(row.name), Text(row.text), style=STATUS_STYLE[row.status] or None)
    return table
