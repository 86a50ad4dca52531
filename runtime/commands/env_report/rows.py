"""The report's values: sections of rows, each row a name, the text a person reads, the figure a
bug report's JSON keeps, and whether its probe found something to look at or failed.

A probe is a function returning rows; ``run_probe`` turns any exception it raises into one row
saying why, so one broken probe (a missing driver, an unreadable file) never ends the report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

JsonValue = Any
"""A value ``json.dumps`` takes: None, bool, int, float, str, or lists and dicts of them."""


class Status(str, Enum):
    OK = "ok"
    NOTE = "note"
    """Worth a look (a limit below what the job may need, a tier that is missing)."""
    FAILED = "failed"
    """The probe itself failed; the text says why."""


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    text: str
    value: JsonValue = None
    """The figure for ``--json`` (bytes, rates per second, counts); None: the text stands."""
    status: Status = Status.OK

    def to_json(self) -> dict[str, JsonValue]:
        body: dict[str, JsonValue] = {"name": self.name, "text": self.text}
        if self.value is not None:
            body["value"] = self.value
        if self.status is not Status.OK:
            body["status"] = self.status.value
        return body


@dataclass(frozen=True, slots=True)
class Section:
    title: str
    rows: list[Row] = field(default_factory=list)

    def to_json(self) -> dict[str, JsonValue]:
        return {"title": self.title, "rows": [row.to_json() for row in self.rows]}


Probe = Callable[[], list[Row]]


def run_probe(name: str, probe: Probe) -> list[Row]:
    """The probe's rows, or one failed row named ``name`` saying what went wrong."""
    try:
        return probe()
    except Exception as err:  # noqa: BLE001 - any failure becomes a row, never a traceback
        return [failed(name, err)]


def failed(name: str, err: BaseException | str) -> Row:
    reason = err if isinstance(err, str) else describe(err)
    return Row(name, f"probe failed: {reason}", status=Status.FAILED)


def describe(err: BaseException) -> str:
    """The exception's type and message, as a row shows why a probe failed."""
    return f"{type(err).__name__}: {err}".rstrip(": ")


def format_bytes(num_bytes: float) -> str:
    """Binary units with one decimal ("1.5 GiB"): the report's sizes."""
    if abs(num_bytes) < 1024:
        return f"{int(num_bytes)} B"
    value = num_bytes / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def format_rate(bytes_per_s: float) -> str:
    """Decimal GB/s or MB/s, as drive and link rates are quoted."""
    if bytes_per_s >= 1e9:
        return f"{bytes_per_s / 1e9:.2f} GB/s"
    return f"{bytes_per_s / 1e6:.1f} MB/s"


def format_age(seconds: float) -> str:
    """ "42 s", "7 min", "3 h 5 min", "12 d 4 h": ages of cache entries."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"
