"""What the engines alive in one process must not both take: the device, a checkpoint directory.

A teacher and a student, or an actor and a critic, are two engines alive at once in one process;
so are a notebook's engine and the one its re-run cell makes, two Trainers of one script, and an
engine an exception left behind. Most of what an engine owns is its own (chunks, side streams,
activation files, run folder, process group: see ``runtime.hw.distributed``); this module keeps the
few claims that would collide, registered at ``initialize`` and released at ``close`` (or when
the engine is dropped: ``runtime.training.state``):

- **The device.** ``memory.device_budget: auto`` is what is free now: the device's capacity
  (CUDA: its total minus a reserve) less what the live engines hold. An engine with a hand-set
  budget holds that budget; an ``auto`` engine holds its budget until its plan predicts a peak,
  and then that peak (with the search's margin): the rest is free for the next engine. Only
  when nothing is left, or the planner finds no plan in what is, is a new engine refused, with
  each live engine named (where it was made) and how to free it.
- **A checkpoint directory.** Two engines saving ``step-N`` into one directory would overwrite
  each other's checkpoints and resume from the wrong one.
- **Seeding.** ``initialize`` seeds the process's random streams (``seed + rank``) only when no
  other engine is alive: reseeding under a running engine would change its dropout masks.

The registry is per process, and every rank makes the same calls in the same order, so every
rank decides alike (before any collective).
"""

from __future__ import annotations

import gc
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from protrain.runtime.config.job import ClaimRequest
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.hw import device_wall
from protrain.runtime.hw.device import DeviceInfo

PLAN_MARGIN = 0.05
"""An auto engine holds its plan's predicted device peak times (1 + this): the search's margin."""


@dataclass(slots=True, kw_only=True)
class EngineClaim:
    """One live engine's share of the process's resources; ``release`` at close."""

    label: int
    """The engine's number in this process, for messages (1 = the first initialized)."""
    device_budget_bytes: int
    device_budget_auto: bool
    checkpoint_dir: Path | None
    created_at: str = "(unknown)"
    """Where the caller made the engine (file:line), for messages."""
    holds_bytes: int = 0
    """What this engine holds of the device (see the module docstring)."""
    wall: device_wall.Account | None = None
    """The device wall's count of this engine's device tier (None: the wall is down)."""
    released: bool = False

    def hold_plan(self, predicted_peak_bytes: int | None) -> None:
        """A plan is in force: an auto engine now holds its predicted peak, not its budget."""
        if self.device_budget_auto and predicted_peak_bytes is not None:
            self.holds_bytes = min(self.device_budget_bytes, int(predicted_peak_bytes * (1 + PLAN_MARGIN)))

    def describe(self) -> str:
        if not self.device_budget_auto:
            what = "its memory.device_budget"
        elif self.holds_bytes < self.device_budget_bytes:
            what = "its plan's predicted peak"
        else:
            what = "auto: its plan predicts no peak yet"
        return (
            f"engine {self.label} (made at {self.created_at}) holds {_gib(self.holds_bytes)} ({what}): "
            "close it (engine.close(), trainer.end()) or drop every reference to it"
        )

    def release(self) -> None:
        with _LOCK:
            if not self.released:
                self.released = True
                _LIVE.remove(self)
                device_wall.close_account(self.wall)


_LIVE: list[EngineClaim] = []
_LOCK = threading.RLock()
"""Reentrant: a collection that runs while it is held (any allocation may start one) may
finalize a dropped engine, whose release takes it again on the same thread."""
_COUNTER = [0]


def collect_earlier_engines() -> None:
    """Collect the garbage earlier engines may have left: a dropped engine caught in a reference
    cycle (an exception's traceback holding a forward's outputs, whose graph holds the engine)
    keeps its device memory until Python's collector runs, and neither CUDA's allocator nor a
    full device runs it. Called before the second and later engines of a process measure and
    claim the device (an engine's initialize takes seconds; a collection, milliseconds)."""
    with _LOCK:
        earlier = _COUNTER[0] > 0
    # Outside the lock: a collected engine's finalizer releases its claim. Twice at least: the
    # finalizer held the engine's state, which only the next collection finds unreachable.
    for _ in range(3 if earlier else 0):
        if not gc.collect():
            break


def others_alive() -> bool:
    """Whether an engine is alive in this process (before this one registers)."""
    with _LOCK:
        return bool(_LIVE)


def claim(
    *,
    device_budget: int | None,
    measured_auto_bytes: int,
    checkpoint_dir: Path | None,
    device: torch.device | None = None,
    created_at: str = "(unknown)",
) -> EngineClaim:
    """Register a new engine. ``device_budget``: the spec's bytes, or None for auto, which then
    becomes ``measured_auto_bytes`` (the device's capacity) less what the live engines hold.
    Raises ``SpecError`` naming what to do when the new engine would collide with a live one."""
    with _LOCK:
        for other in list(_LIVE):
            if checkpoint_dir is not None and other.checkpoint_dir == checkpoint_dir:
                raise SpecError(
                    f"checkpoint.dir: {checkpoint_dir} is used by engine {other.label} of this process; "
                    "give each engine its own checkpoint directory"
                )
        budget = device_budget
        if budget is None:
            budget = measured_auto_bytes - sum(other.holds_bytes for other in _LIVE)
            if budget <= 0:
                raise SpecError(
                    f"memory.device_budget: auto leaves nothing of the {_gib(measured_auto_bytes)} available: "
                    + "; ".join(other.describe() for other in _LIVE)
                    + "; or set this engine's memory.device_budget"
                )
        _COUNTER[0] += 1
        entry = EngineClaim(
            label=_COUNTER[0],
            device_budget_bytes=budget,
            device_budget_auto=device_budget is None,
            checkpoint_dir=checkpoint_dir,
            created_at=created_at,
            holds_bytes=budget,
        )
        if device is not None:
            entry.wall = device_wall.open_account(f"engine {entry.label}", budget, device)
        _LIVE.append(entry)
        return entry


def _call_site() -> str:
    """Where the caller made the engine: the innermost frame outside ProTrain and the libraries
    that call it for the caller (a Trainer's seams), as file:line."""
    ours = str(Path(__file__).resolve().parents[1])  # runtime/
    frames = traceback.extract_stack()[:-2]
    for frame in reversed(frames):
        path = frame.filename
        if not path.startswith(ours) and "site-packages" not in path and not path.startswith("<"):
            return f"{path}:{frame.lineno}"
    return f"{frames[0].filename}:{frames[0].lineno}" if frames else "(unknown)"


def claim_for(
    request: ClaimRequest, device: DeviceInfo, *, ranks_on_host: int, capacity: Callable[[DeviceInfo, int], int]
) -> EngineClaim:
    """This engine's device budget and checkpoint directory, registered against the other engines
    alive in this process (an auto budget is what they left of ``capacity(device, ranks_on_host)``)."""
    auto = request.device_budget is None
    collect_earlier_engines()
    return claim(
        device_budget=request.device_budget,
        measured_auto_bytes=capacity(device, ranks_on_host) if auto else 0,
        checkpoint_dir=request.checkpoint_dir,
        device=device.device,
        created_at=_call_site(),
    )


def crowded_note(entry: EngineClaim) -> str:
    """For a refusal of ``entry``'s auto budget: which live engines hold the rest ("" if none)."""
    with _LOCK:
        others = [other for other in _LIVE if other is not entry]
    if not entry.device_budget_auto or not others:
        return ""
    return "; the rest of the device is held by " + "; ".join(other.describe() for other in others)


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
