"""What rank 0 shows the user: the plan as a table, then progress with loss, tokens/s and step
time. Other ranks print nothing unless they fail. Every optimizer step also goes to a JSONL file.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from protrain.profiler.plan import Plan
from protrain.runtime.config.settings import OptimizerSettings

if TYPE_CHECKING:  # the launcher imports this module (plan_table) and must not import torch
    from torch import nn

    from protrain.runtime.chunks.layout import ParamInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One optimizer update as the user sees it."""

    step: int
    loss: float
    lr: float
    grad_norm: float | None
    step_time_s: float
    tokens_per_s: float
    skipped: bool
    loss_scale: float | None
    waits: dict[str, float] = field(default_factory=dict)
    """Seconds the main thread waited for the pipeline (runtime/chunks/waits.py), by kind."""
    tokens: int = 0
    """Token ids the window trained on, all ranks (0: its batches had none)."""
    samples: int = 0
    """Sequences the window trained on, all ranks."""

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "step": self.step,
            "loss": self.loss,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "step_time_s": round(self.step_time_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "skipped": self.skipped,
            "time": time.time(),
        }
        if self.loss_scale is not None:
            record["loss_scale"] = self.loss_scale
        if self.waits:
            record["waits"] = self.waits
        return record


def plan_table(plan: Plan, *, title: str = "ProTrain plan") -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("knob")
    table.add_column("value", justify="right")
    table.add_column("from")
    for knob, value, origin in plan.rows():
        table.add_row(knob, value, origin)
    lines = [plan.rule, *plan.notes] if plan.rule else list(plan.notes)
    if lines:
        table.caption = "\n".join(lines)
        table.caption_justify = "left"
    return table


def groups_table(model: nn.Module, params: Sequence[ParamInfo], optimizer: OptimizerSettings) -> Table | None:
    """When the spec sets ``optimizer.groups``, one row per parameter group: its patterns, its
    values and what it took (trainable parameters and their elements: a pattern that matched
    nothing shows 0); None otherwise."""
    if not optimizer.groups:
        return None
    from protrain.runtime.param_groups import resolve_param_hyper  # imports torch (see the imports above)

    trainable = [p for p in params if p.trainable]
    hyper = resolve_param_hyper(model, [(p.name, *p.aliases) for p in trainable], optimizer)
    table = Table(title="Optimizer groups (the first match wins)", title_justify="left")
    for column in ("group", "match", "lr", "weight_decay", "betas", "params", "elements"):
        # Patterns are what a user checks: folded, never cut short.
        table.add_column(column, justify="left" if column == "match" else "right", overflow="fold")
    for group in hyper.groups:
        members = [p.numel for p, g in zip(trainable, hyper.group_of_param, strict=True) if g == group.index]
        table.add_row(
            str(group.index),
            _patterns(group.match),
            f"{group.lr:g}",
            f"{group.weight_decay:g}",
            f"{group.betas[0]:g}, {group.betas[1]:g}",
            str(len(members)),
            f"{sum(members):,}",
        )
    table.caption = "lr: the peak, scaled by the scheduler; biases and norms (no_decay) take no weight decay"
    table.caption_justify = "left"
    return table


def _patterns(match: Sequence[str]) -> str:
    """A group's patterns, or for a long list of exact names (the Trainer's no-decay group: every
    bias and norm by name) their count and the first two."""
    if not match:
        return "(the rest: top level)"
    if len(match) <= 4:
        return ", ".join(match)
    return f"{len(match)} names: {match[0]}, {match[1]}, ..."


def frozen_note(params: Sequence[ParamInfo], compute_element_size: int) -> str | None:
    """What frozen parameters (a LoRA base, say) save, when the model has any: they sit in
    frozen chunks with their compute copy only, no fp32 master, gradient or Adam moments."""
    frozen = sum(p.numel for p in params if not p.trainable)
    if not frozen:
        return None
    total = sum(p.numel for p in params)
    saved = frozen * (16 - compute_element_size)  # fp32 master, gradient, two moments vs one copy
    return (
        f"frozen: {frozen:,} of {total:,} parameters ({100 * frozen / total:.1f}%) in frozen chunks, "
        f"with no gradient or optimizer state: {saved / 2**20:,.1f} MiB less than training them "
        f"({16 - compute_element_size} bytes per parameter)"
    )


class MetricsFile:
    """Appends one JSON object per line; flushed per line so a crash loses nothing committed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


_LIVE_BAR_OWNER: list[ProgressReporter] = []
"""The one reporter of the process showing a live bar: two bars redrawing one terminal garble
each other, so a second engine alive at once (a teacher beside a student) prints plain lines."""


class ProgressReporter:
    """A live progress bar on a terminal; on a pipe or file, one plain line every few steps.
    ``name`` prefixes every line (a second engine of the process says which it is)."""

    def __init__(
        self,
        *,
        total_steps: int | None,
        enabled: bool,
        stream: TextIO | None = None,
        name: str | None = None,
        level: str = "info",
    ) -> None:
        """``level`` (``logging.level``): quiet prints nothing (errors still raise, metrics.jsonl
        is still written), info the plan, progress and plan check, debug also every update's
        line with its waits."""
        self.enabled = enabled and level != "quiet"
        self.debug = level == "debug"
        self.console = Console(file=stream or sys.stdout, highlight=False)
        self.total_steps = total_steps
        self._prefix = f"{name}: " if name else ""
        self._progress: Progress | None = None
        self._task: Any = None
        self._line_every = max(1, (total_steps or 100) // 20)
        self._plan_deferred = False

    def show_plan(self, plan: Plan, extras: Sequence[Table | str | None] = (), *, deferred: bool = False) -> None:
        """The plan's table, then what else describes the run (the optimizer groups' table, the
        frozen parameters' line; None entries are skipped). ``deferred``: the plan is settled on
        the first batch, whose table follows then: one line now, so an engine shows one table."""
        self._plan_deferred = deferred
        if self.enabled:
            if deferred:
                self.console.print(f"{self._prefix}ProTrain plan: settled on the first batch (until then, {plan.rule})")
            else:
                self.console.print(plan_table(plan))
            for extra in extras:
                if extra is not None:
                    self.console.print(extra)

    def show_deferred_plan(self, plan: Plan) -> None:
        """The table of a plan whose settling on the first batch came to nothing new (no loss
        to profile): it stays, and is shown now."""
        if self._plan_deferred:
            self.show_plan(plan)

    def print(self, text: str) -> None:
        if self.enabled:
            self.console.print(self._prefix + text)

    def update(self, record: StepRecord) -> None:
        if not self.enabled:
            return
        summary = (
            f"loss {record.loss:.4f}  lr {record.lr:.2e}  {record.tokens_per_s:,.0f} tok/s  "
            f"{record.step_time_s * 1000:.0f} ms/step" + ("  (skipped)" if record.skipped else "")
        )
        if self.debug:
            waits = "  ".join(f"{kind} {seconds * 1000:.1f}" for kind, seconds in (record.waits or {}).items())
            summary += f"  waits (ms): {waits}" if waits else ""
        if self.console.is_terminal and not self.debug and _LIVE_BAR_OWNER in ([], [self]):
            self._live_update(record.step, summary)
        elif self.debug or record.step == 1 or record.step % self._line_every == 0 or record.step == self.total_steps:
            # total_steps is the schedule's length; a script may run past it.
            total = f"/{self.total_steps}" if self.total_steps and record.step <= self.total_steps else ""
            self.console.print(f"{self._prefix}step {record.step}{total}  {summary}", soft_wrap=True)

    def _live_update(self, step: int, summary: str) -> None:
        if self._progress is None:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[summary]}"),
                console=self.console,
                transient=False,
            )
            self._progress.start()
            _LIVE_BAR_OWNER.append(self)
            self._task = self._progress.add_task("train", total=self.total_steps, summary="")
        if self.total_steps is not None and step > self.total_steps:
            self._progress.update(self._task, total=None)
        self._progress.update(self._task, completed=step, summary=summary)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
            _LIVE_BAR_OWNER.remove(self)
