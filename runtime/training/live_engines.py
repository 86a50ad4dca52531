"""What the engines alive in one process must not both take: the device, a checkpoint directory.

A teacher and a student, or an actor and a critic, are two engines alive at once in one process.
Most of what an engine owns is its own (chunks, side streams, activation files, run folder,
process group: see ``runtime.distributed``); this module keeps the few claims that would
collide, registered at ``initialize`` and released at ``close``:

- **The device budget.** ``memory.device_budget: auto`` means "the whole device" (CUDA: its total
  minus a reserve). Two engines that each planned for the whole device would together run out of
  memory mid-step, so an ``auto`` budget is what is left after the budgets the live engines set
  by hand, and a second ``auto`` while the first engine holds an ``auto`` budget is refused with
  what to set.
- **A checkpoint directory.** Two engines saving ``step-N`` into one directory would overwrite
  each other's checkpoints and resume from the wrong one.
- **Seeding.** ``initialize`` seeds the process's random streams (``seed + rank``) only when no
  other engine is alive: reseeding under a running engine would change its dropout masks.

The registry is per process, and every rank makes the same calls in the same order, so every
rank decides alike (before any collective).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from runtime.config.spec_io import SpecError


@dataclass(slots=True, kw_only=True)
class EngineClaim:
    """One live engine's share of the process's resources; ``release`` at close."""

    label: int
    """The engine's number in this process, for messages (1 = the first initialized)."""
    device_budget_bytes: int
    device_budget_auto: bool
    checkpoint_dir: Path | None
    released: bool = False

    def release(self) -> None:
        with _LOCK:
            if not self.released:
                self.released = True
                _LIVE.remove(self)


_LIVE: list[EngineClaim] = []
_LOCK = threading.Lock()
_COUNTER = [0]


def others_alive() -> bool:
    """Whether an engine is alive in this process (before this one registers)."""
    with _LOCK:
        return bool(_LIVE)


def claim(*, device_budget: int | None, measured_auto_bytes: int, checkpoint_dir: Path | None) -> EngineClaim:
    """Register a new engine. ``device_budget``: the spec's bytes, or None for auto, which then
    becomes ``measured_auto_bytes`` less the budgets the live engines set. Raises ``SpecError``
    naming what to set when the new engine would collide with a live one."""
    with _LOCK:
        for other in _LIVE:
            if device_budget is None and other.device_budget_auto:
                raise SpecError(
                    f"memory.device_budget: auto: engine {other.label} of this process already planned "
                    f"for the whole device ({other.device_budget_bytes / 2**30:.2f} GiB, auto), so a second "
                    "engine cannot claim it too; set memory.device_budget on each engine so that they add "
                    f"up to at most {other.device_budget_bytes / 2**30:.2f} GiB (e.g. half each)"
                )
            if checkpoint_dir is not None and other.checkpoint_dir == checkpoint_dir:
                raise SpecError(
                    f"checkpoint.dir: {checkpoint_dir} is used by engine {other.label} of this process; "
                    "give each engine its own checkpoint directory"
                )
        budget = device_budget
        if budget is None:
            budget = measured_auto_bytes - sum(other.device_budget_bytes for other in _LIVE)
            if budget <= 0:
                taken = sum(other.device_budget_bytes for other in _LIVE)
                raise SpecError(
                    f"memory.device_budget: auto leaves nothing: the engines alive in this process set "
                    f"{taken / 2**30:.2f} GiB of the {measured_auto_bytes / 2**30:.2f} GiB available; "
                    "lower their memory.device_budget or set this engine's"
                )
        _COUNTER[0] += 1
        entry = EngineClaim(
            label=_COUNTER[0],
            device_budget_bytes=budget,
            device_budget_auto=device_budget is None,
            checkpoint_dir=checkpoint_dir,
        )
        _LIVE.append(entry)
        return entry
