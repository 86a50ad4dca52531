"""The profile cache: profiles measured once are kept as JSON under ``profiler.cache_dir`` and
read back by later launches, when every rank has them (measuring takes all ranks, so either all
use the cache or none does). ``ProfileOrigin`` notes which entries the plan in force came from,
so the engine can drop them when the measured step time says they are stale.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from protrain.runtime.hw.distributed import DistContext, all_reduce_min_

T = TypeVar("T")
REFRESH_ENV = "PROTRAIN_REFRESH_PROFILE"
"""Set to 1 to measure the hardware again instead of using the cached profile."""
FOUND_OFF = "found_off"
"""Key of a cache entry: the plan check of the launch that last found the entry off (the
profile's own fields are the rest)."""


def read_agreed(path: Path, parse: Callable[[dict[str, Any]], T], dist_ctx: DistContext | None) -> T | None:
    """The cached value at ``path`` if every rank has one (measuring takes all ranks, so either
    all use the cache or none does); ``PROTRAIN_REFRESH_PROFILE=1`` ignores caches."""
    cached: T | None = None
    if os.environ.get(REFRESH_ENV) != "1":
        try:
            body = json.loads(path.read_text())
            body.pop(FOUND_OFF, None)
            cached = parse(body)
        except (OSError, ValueError, TypeError, KeyError):
            cached = None
    have = torch.tensor([1.0 if cached is not None else 0.0], dtype=torch.float64)
    if dist_ctx is not None:
        all_reduce_min_(have, dist_ctx)
    return cached if have.item() > 0 else None


def write_cached(path: Path, body: dict[str, Any]) -> None:
    """Write atomically (ranks or jobs writing at once leave one whole file); a cache that
    cannot be written is only a cache."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        # Per process and thread: two engines of one process may profile from two threads.
        temporary = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
        temporary.write_text(json.dumps(body, indent=1))
        temporary.replace(path)


@dataclasses.dataclass(slots=True)
class ProfileOrigin:
    """The profile cache entries the plan in force was made from; empty when every profile was
    measured in this run. Each profiling starts it over. The engine drops these entries when the
    measured step time says they are stale (``runtime.planning.plan_check``): the next launch measures."""

    cached: list[Path] = dataclasses.field(default_factory=list)
    found_off_before: set[Path] = dataclasses.field(default_factory=set)
    """Of ``cached``, the entries the previous launch found off (read with them, before any rank
    of this launch could note anything)."""

    def add(self, path: Path) -> None:
        """``path`` was read from the cache (by every rank) for the plan in force."""
        self.cached.append(path)
        with contextlib.suppress(OSError, ValueError):
            if FOUND_OFF in json.loads(path.read_text()):
                self.found_off_before.add(path)

    def clear(self) -> None:
        self.cached.clear()
        self.found_off_before.clear()

    def found_off(self, check: dict[str, Any]) -> list[Path]:
        """This launch found the plan's prediction off: the entries the previous launch found
        off too are removed (returned: those now gone; another rank on the host may have removed
        one first); the others keep ``check`` for the next launch to confirm."""
        gone = []
        for path in self.cached:
            if path in self.found_off_before:
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
                    gone.append(path)
            else:
                self._rewrite(path, lambda body: {**body, FOUND_OFF: check})
        return gone

    def found_right(self) -> None:
        """This launch found the prediction right: an earlier finding was a passing moment."""
        for path in self.found_off_before:
            self._rewrite(path, lambda body: {k: v for k, v in body.items() if k != FOUND_OFF})

    @staticmethod
    def _rewrite(path: Path, change: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        with contextlib.suppress(OSError, ValueError):
            write_cached(path, change(json.loads(path.read_text())))
