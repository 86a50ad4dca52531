"""Where rank 0 sends each update's metrics besides metrics.jsonl (the spec's ``logging``).

One interface (``Tracker``: ``log(metrics, step)``, ``close()``) over TensorBoard and Weights &
Biases, fed update 1 and every ``logging.every_steps`` updates with the names metrics.jsonl uses.

- TensorBoard: an event file under ``<run folder>/tensorboard``, one event per update holding
  every scalar (``TensorBoardTracker`` says why it is not ``torch.utils.tensorboard``'s writer).
  Needs the ``tensorboard`` package (the ``logging`` extra): asked for without it,
  ``initialize`` refuses to start, on every rank alike.
- W&B: only when the ``wandb`` package is installed (never a dependency of ours); asked for
  without it, the run says so once and goes on without it. The run's config is its resolved
  spec (``spec.json`` in the run folder).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from protrain.runtime.config.settings import LoggingSettings
from protrain.runtime.config.spec_io import SpecError

TENSORBOARD_DIR = "tensorboard"
MISSING_TENSORBOARD = (
    "logging.tensorboard is true but the tensorboard package is not installed: "
    "pip install 'protrain[logging]' (or tensorboard), or set logging.tensorboard: false"
)


class Tracker(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def require_tracker_packages(*, tensorboard: bool) -> None:
    """SpecError when ``logging.tensorboard`` is on and its package is missing (checked on every
    rank before any starts: one rank failing alone would leave the others waiting)."""
    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise SpecError(MISSING_TENSORBOARD)


class TensorBoardTracker:
    """TensorBoard's event file format, written on the calling thread.

    ``torch.utils.tensorboard``'s writer hands each event to a thread of its own, which
    checksums it in pure Python (tensorboard's CRC32C stand-in without TensorFlow) while holding
    the GIL: a cost that would land on training unseen by the logger's own timing. Here the same
    records (tensorboard's ``RecordWriter``, one ``Event`` per update holding every scalar) are
    written where they are asked for, so they are paid and timed there
    (docs/decisions/0009-tensorboard-events-on-the-calling-thread.md).
    """

    def __init__(self, log_dir: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        log_dir.mkdir(parents=True, exist_ok=True)
        # The name TensorBoard's loaders look for (as its own writer names files).
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILES)}"
        self.path = log_dir / name
        self._file = self.path.open("wb")
        self._records = RecordWriter(self._file)
        self._write(self._event(wall_time=time.time(), file_version="brain.Event:2"))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        values = [self._summary.Value(tag=tag, simple_value=value) for tag, value in metrics.items()]
        self._write(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values)))

    def _write(self, event: Any) -> None:
        self._records.write(event.SerializeToString())
        self._file.flush()  # a crash keeps every update written (as metrics.jsonl does)

    def close(self) -> None:
        self._file.close()


_FILES = itertools.count()
"""Event files of this process (two engines alive at once write two)."""


class WandbTracker:
    def __init__(self, wandb: Any, *, project: str, name: str | None, run_dir: Path) -> None:
        spec = run_dir / "spec.json"
        config = json.loads(spec.read_text(encoding="utf-8")) if spec.is_file() else None
        self._run = wandb.init(project=project, name=name, dir=str(run_dir), config=config)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class Trackers:
    """Every tracker the spec asked for, fed on the updates ``logging.every_steps`` picks."""

    def __init__(self, trackers: Sequence[Tracker], *, every_steps: int) -> None:
        self.trackers = list(trackers)
        self.every_steps = every_steps

    def due(self, step: int) -> bool:
        return bool(self.trackers) and (step == 1 or step % self.every_steps == 0)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        errors = []
        for tracker in trackers:
            try:
                tracker.close()
            except Exception as err:  # the others still close; the first failure is raised after
                errors.append(err)
        if errors:
            raise errors[0]


def open_trackers(settings: LoggingSettings, *, run_dir: Path, log: Callable[[str], None]) -> Trackers:
    """The trackers of rank 0's run folder (``log``: a line for the user, e.g. W&B missing)."""
    opened = Trackers([], every_steps=settings.every_steps)
    try:
        if settings.tensorboard:
            require_tracker_packages(tensorboard=True)
            opened.trackers.append(TensorBoardTracker(run_dir / TENSORBOARD_DIR))
        if settings.wandb_project is not None:
            try:
                wandb = importlib.import_module("wandb")
            except ImportError:
                log("logging.wandb: the wandb package is not installed; W&B logging is off")
            else:
                project, name = settings.wandb_project, settings.wandb_name
                opened.trackers.append(WandbTracker(wandb, project=project, name=name, run_dir=run_dir))
    except BaseException:
        opened.close()  # a W&B start that failed leaves no TensorBoard writer open
        raise
    return opened
