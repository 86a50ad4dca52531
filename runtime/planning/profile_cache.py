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

from protrain.runtime.distributed import DistContext, all_reduce_min_

T = TypeVar("T")
REFRESH_ENV = "PROTRAIN_REFRESH_PROFILE"
"""Set to 1 to measure the hardware again instead of using the cached profile."""


def read_agreed(path: Path, parse: Callable[[dict[str, Any]], T], dist_ctx: DistContext | None) -> T | None:
    """The cached value at ``path`` if every rank has one (measuring takes all ranks, so either
    all use the cache or none does); ``PROTRAIN_REFRESH_PROFILE=1`` ignores caches."""
    cached: T | None = None
    if os.environ.get(REFRESH_ENV) != "1":
        try:
            cached = parse(json.loads(path.read_text()))
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

    def drop(self) -> list[Path]:
        """Remove the cached entries; those now gone (another rank on the host may have removed
        one first). An entry that cannot be removed stays, and is left out."""
        gone = []
        for path in self.cached:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
                gone.append(path)
        return gone
