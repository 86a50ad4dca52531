"""Where the main thread waited for the pipeline in a step: the exposed (not overlapped) waits.

Three kinds, each timed where the main thread blocks:

- ``transfer``: compute waiting for a chunk's gather (residency.py) or an activation's way back;
- ``reduce``: backward waiting for a gradient buffer whose reduction is still running, and the
  wait for the side stream when backward ends;
- ``host``: the step waiting for the host worker (gradient adds into host shards, CPU Adam).

Seconds on the host clock. On CUDA a wait for device work is the compute stream's, not the
host's (``make_compute_wait``), so there these count the host side only: a job not yet issued by
its worker thread. Reported per update in metrics.jsonl (``waits``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields


@dataclass(slots=True)
class ExposedWaits:
    transfer_s: float = 0.0
    reduce_s: float = 0.0
    host_s: float = 0.0

    @contextlib.contextmanager
    def timing(self, kind: str) -> Iterator[None]:
        """Add the time spent in the block to ``<kind>_s``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            name = f"{kind}_s"
            setattr(self, name, getattr(self, name) + time.perf_counter() - started)

    def take(self) -> dict[str, float]:
        """The waits since the last ``take``, rounded to microseconds; the counters restart."""
        taken = {f.name: round(getattr(self, f.name), 6) for f in fields(self)}
        for f in fields(self):
            setattr(self, f.name, 0.0)
        return taken
