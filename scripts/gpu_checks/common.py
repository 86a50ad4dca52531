"""What every section of the GPU acceptance run shares: how a result is recorded (a check, a
figure), where it goes (one JSON file per section, rewritten after every check so that a run
cut short still reports what it did), and the small helpers every section needs (the device,
batches on it, honest timing). Importing it loads no torch: the first-contact run's parent process
(first_contact.py) reads the sections' reports without touching the device."""

from __future__ import annotations

import json
import os
import platform
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Figure = float | int | str | bool | None


@dataclass(slots=True, kw_only=True)
class Check:
    """One answer a user would ask for. ``passed`` None: a figure reported, no target."""

    name: str
    passed: bool | None
    detail: str = ""
    figures: dict[str, Figure] = field(default_factory=dict)
    at_s: float | None = None
    """Seconds into the section when it was recorded (where a section's time goes)."""


@dataclass(slots=True, kw_only=True)
class SectionReport:
    """What one section did so far: its checks, whether it ran to the end, and the error that
    stopped it (a traceback's last lines)."""

    name: str
    title: str
    device: str
    rehearsal: bool
    checks: list[Check] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.error is not None or any(c.passed is False for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"failed": self.failed}


@dataclass(slots=True, kw_only=True)
class Context:
    """What a section runs with. ``rehearsal``: on the CPU at tiny sizes (the suite's smoke test
    of the section's code, not of a GPU); sections then skip what only CUDA has."""

    device: torch.device
    scratch: Path
    """A directory of the section's own for files (SSD activations, checkpoints); removed after."""
    rehearsal: bool
    report: SectionReport
    json_path: Path
    out: Path
    """The run's report directory (for files a section leaves beside its JSON, e.g. a trace)."""
    started: float = field(default_factory=time.perf_counter)

    def check(
        self, name: str, passed: bool | None, detail: str = "", **figures: Figure
    ) -> bool | None:
        """Record one check (and rewrite the section's JSON at once); returns ``passed``."""
        at = round(time.perf_counter() - self.started, 1)
        self.report.checks.append(Check(name=name, passed=passed, detail=detail, figures=figures, at_s=at))
        self.save()
        mark = {True: "ok", False: "FAIL", None: "--"}[passed]
        print(f"  [{mark:>4}] {name}: {detail}", flush=True)
        return passed

    def save(self) -> None:
        write_json(self.json_path, self.report.to_json())

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.is_cuda:
            import torch

            torch.cuda.synchronize(self.device)


@dataclass(frozen=True, slots=True, kw_only=True)
class Section:
    name: str
    title: str
    run: Callable[[Context], None]
    cpu_counterpart: str
    """Where the CPU suite checks the same thing (test paths), for the report and the docs."""
    needs_cuda: bool = False
    """Not run in a CPU rehearsal (the suite's counterpart covers its logic there)."""
    record_memory: bool = False
    """On CUDA, record every allocation's stack, so that an out-of-memory error says what held
    the device (oom_breakdown.py; for small stages: it slows allocation)."""


def write_json(path: Path, value: Any) -> None:
    """Write through a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def machine_facts() -> dict[str, Figure]:
    import torch

    facts: dict[str, Figure] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host_cores": os.cpu_count(),
        "host_memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts |= {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
            "capability": f"{props.major}.{props.minor}",
        }
    return facts


@contextmanager
def timed() -> Iterator[Callable[[], float]]:
    """Wall seconds of the block (read the result after it); the caller synchronizes the device
    where the block's device work must be counted."""
    start = time.perf_counter()
    end: list[float] = []
    yield lambda: (end[0] if end else time.perf_counter()) - start
    end.append(time.perf_counter())


def short_traceback(error: BaseException, lines: int = 12) -> str:
    text = "".join(traceback.format_exception(error))
    return "\n".join(text.rstrip().splitlines()[-lines:])
