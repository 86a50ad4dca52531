"""The Markdown summary of a GPU acceptance run, from the sections' reports."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from gpu_checks.common import Figure, SectionReport


def figure_text(value: Figure) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def checks_table(checks: Sequence[Mapping[str, Any]]) -> list[str]:
    """A section's checks (each ``Check`` as a dict, as its JSON holds it) as a Markdown table."""
    if not checks:
        return []
    lines = ["| check | result | at (s) | detail | figures |", "| --- | --- | --- | --- | --- |"]
    for check in checks:
        mark = {True: "ok", False: "**FAIL**", None: "figure"}[check["passed"]]
        figures = ", ".join(f"{k}={figure_text(v)}" for k, v in check["figures"].items())
        at = "" if check.get("at_s") is None else check["at_s"]
        lines.append(f"| {cell(check['name'])} | {mark} | {at} | {cell(check['detail'])} | {cell(figures)} |")
    return [*lines, ""]


def markdown(reports: Sequence[SectionReport], facts: dict[str, Figure], command: str) -> str:
    failed = [r.name for r in reports if r.failed]
    lines = [
        "# ProTrain GPU check",
        "",
        f"Command: `{command}`",
        "",
        "Machine: " + ", ".join(f"{k} {figure_text(v)}" for k, v in facts.items()),
        "",
        f"**Verdict: {'FAILED (' + ', '.join(failed) + ')' if failed else 'all checks passed'}**",
        "",
    ]
    for report in reports:
        state = "error" if report.error else ("FAILED" if report.failed else "passed")
        if not report.finished and not report.error:
            state += ", cut short"
        where = "CPU rehearsal" if report.rehearsal else report.device
        lines += [f"## {report.name}: {report.title}", "", f"{state}; {where}; {report.seconds:.0f} s", ""]
        lines += checks_table([asdict(check) for check in report.checks])
        if report.error:
            lines += ["```", report.error, "```", ""]
    return "\n".join(lines) + "\n"
