"""The report's values: sections of rows, each a name, the text a person reads, the figure ``--json``
keeps and a status; ``run_probe`` turns a probe's exception into a row, so the report always ends."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Status(str, Enum):
    OK = "ok"
    NOTE = "note"  # worth a look: a small limit, no driver
    FAILED = "failed"  # the probe itself failed; the text says why


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    text: str
    value: Any = None  # bytes, counts, versions; None: the text stands
    status: Status = Status.OK

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"name": self.name, "text": self.text}
        if self.value is not None:
            body["value"] = self.value
        if self.status is not Status.OK:
            body["status"] = self.status.value
        return body


@dataclass(frozen=True, slots=True)
class Section:
    title: str
    rows: list[Row] = field(default_factory=list)


def run_probe(name: str, probe: Callable[[], list[Row]]) -> list[Row]:
    try:
        return probe()
    except Exception as err:  # noqa: BLE001 - any failure becomes a row, never a traceback
        return [Row(name, f"probe failed: {describe(err)}", status=Status.FAILED)]


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".rstrip(": ")


def note_if(flag: bool) -> Status:
    return Status.NOTE if flag else Status.OK


def format_bytes(num_bytes: float) -> str:
    """Binary units with one decimal ("1.5 GiB")."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024:
            return f"{int(num_bytes)} B" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"


def format_rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.1f} MB/s"
