"""The Markdown summary of a GPU acceptance run, from the sections' reports."""

from __future__ import annotations

from collections.abc import Sequence

from gpu_checks.common import Figure, SectionReport


def _figure(value: Figure) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(reports: Sequence[SectionReport], facts: dict[str, Figure], command: str) -> str:
    failed = [r.name for r in reports if r.failed]
    lines = [
        "# ProTrain GPU check",
        "",
        f"Command: `{command}`",
        "",
        "Machine: " + ", ".join(f"{k} {_figure(v)}" for k, v in facts.items()),
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
        if report.checks:
            lines += ["| check | result | detail | figures |", "| --- | --- | --- | --- |"]
            for check in report.checks:
                mark = {True: "ok", False: "**FAIL**", None: "figure"}[check.passed]
                figures = ", ".join(f"{k}={_figure(v)}" for k, v in check.figures.items())
                lines.append(f"| {_cell(check.name)} | {mark} | {_cell(check.detail)} | {_cell(figures)} |")
            lines.append("")
        if report.error:
            lines += ["```", report.error, "```", ""]
    return "\n".join(lines) + "\n"
