"""The first-contact run's ``report.md``, rendered from its ``summary.json`` (first_contact.py
writes both at every change). Every stage is named, those not run yet too, so a report read
after the run was killed says what ran, what did not, and why."""

from __future__ import annotations

from typing import Any

from gpu_checks.report import cell, checks_table, figure_text

REPORT_FILE = "report.md"
SUMMARY_FILE = "summary.json"
TRACE_FILE = "trace.json.gz"
LOG_FILE = "first-contact.log"
FILES = (REPORT_FILE, SUMMARY_FILE, TRACE_FILE, LOG_FILE)
"""Everything a run leaves in its directory."""

STATE_WORDS = {
    "pending": "not run (the run ended before it)",
    "running": "running (or cut short while running)",
    "interrupted": "interrupted",
    "passed": "passed",
    "failed": "FAILED (a check failed)",
    "error": "ERROR (raised)",
    "timed out": "TIMED OUT (every thread's stack at the timeout is in the log)",
}


def _verdict(summary: dict[str, Any]) -> str:
    sections = summary["sections"]
    fine = ("passed", "pending", "running")
    bad = [f"{name} ({s['state']})" for name, s in sections.items() if s["state"] not in fine]
    if not summary["complete"]:
        done = sum(s["state"] not in ("pending", "running") for s in sections.values())
        head = f"incomplete: {done} of {len(sections)} stages done"
        return head + (f"; so far FAILED: {', '.join(bad)}" if bad else "; none failed so far")
    return f"FAILED: {', '.join(bad)}" if bad else f"all {len(sections)} stages passed"


def _counts(checks: list[dict[str, Any]]) -> str:
    ok = sum(c["passed"] is True for c in checks)
    failed = sum(c["passed"] is False for c in checks)
    figures = sum(c["passed"] is None for c in checks)
    return f"{ok} / {failed} / {figures}"


def render(summary: dict[str, Any]) -> str:
    machine = ", ".join(f"{k} {figure_text(v)}" for k, v in summary["machine"].items())
    lines = [
        "# ProTrain first contact",
        "",
        f"Command: `{summary['command']}`",
        "",
        f"Mode: {summary['mode']}; started {summary['started_at']}; {summary['elapsed_s']:.0f} s"
        + (" in all" if summary["complete"] else " so far, not complete")
        + (f"; interrupted ({summary['interrupted']})" if summary["interrupted"] else ""),
        "",
        f"Machine: {machine}",
        "",
        f"**Verdict: {_verdict(summary)}**",
        "",
        f"Trace: {summary['trace'] or 'none kept'}. Log: {LOG_FILE}.",
        "",
    ]
    lines += [f"- {note}" for note in summary["notes"]] + ([""] if summary["notes"] else [])
    lines += [
        "| stage | state | seconds | timeout (s) | checks ok / failed / figures |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, section in summary["sections"].items():
        lines.append(
            f"| {name} | {section['state']} | {section['seconds']:.1f} | {section['timeout_s']:.0f} "
            f"| {_counts(section['checks'])} |"
        )
    lines.append("")
    for name, section in summary["sections"].items():
        state = STATE_WORDS.get(section["state"], section["state"])
        lines += [f"## {name}: {cell(section['title'])}", "", f"{state}; {section['seconds']:.1f} s", ""]
        lines += checks_table(section["checks"])
        if section["error"]:
            lines += ["```", section["error"].replace("```", "'''"), "```", ""]
    return "\n".join(lines) + "\n"
