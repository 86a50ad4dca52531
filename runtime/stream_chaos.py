"""Stream chaos: a test mode that makes CPU runs show the ordering bugs CUDA would.

On CPU every side-stream job runs on a worker thread that usually finishes long before anyone
looks, so a missing wait goes unseen: the data is there by luck. ``PROTRAIN_STREAM_CHAOS`` takes
that luck away:

- ``1`` (random): every side-stream and host-worker job is delayed by a random 0-5 ms before it
  runs, from a ``random.Random`` of its own (never torch's generator: chaos must not change the
  training's random streams), seeded by ``PROTRAIN_STREAM_CHAOS_SEED`` (default 0) and the
  worker's name, so a failing seed replays;
- ``lazy``: a job runs only once its event (or a later one of the same worker) is waited on: the
  deterministic worst case, where nothing queued ever happens early;

and, in both, every buffer handed back to a pool (device chunk buffers, gradient buffers,
staging buffers, swap buffers) is filled with NaN before reuse, and handing back a buffer whose
event is still pending raises: a read through a missing wait then yields NaN, which the
equivalence tests and the zero-skipped-steps check see.

What chaos cannot catch on CPU waits for ``TORCH_CUDA_SANITIZER=1`` on a GPU: ordering between
the compute stream and a side stream inside the device (on CPU compute runs on the host thread,
which waits for real), the caching allocator handing a block to another stream while a kernel
still reads it (``record_stream``), a copy that is really an alias on one device and a copy on
another, and autograd's own backward thread and stream.
"""

from __future__ import annotations

import os
import random
import threading
import time
import zlib
from dataclasses import dataclass, field

import torch

ENV = "PROTRAIN_STREAM_CHAOS"
SEED_ENV = "PROTRAIN_STREAM_CHAOS_SEED"
MAX_DELAY_S = 0.005
MODES = ("0", "1", "lazy")


@dataclass(slots=True)
class StreamChaos:
    """One worker's chaos: its delays (own seeded generator) and whether it is lazy."""

    lazy: bool
    seed: int
    rng: random.Random = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def delay(self) -> None:
        """Sleep a random 0-5 ms (random mode; the lazy mode's delay is the wait itself)."""
        if self.lazy:
            return
        with self._lock:
            seconds = self.rng.uniform(0.0, MAX_DELAY_S)
        time.sleep(seconds)


def mode() -> str:
    """``PROTRAIN_STREAM_CHAOS``: "0" (off, the default), "1" (random delays) or "lazy"."""
    value = os.environ.get(ENV, "0").strip().lower() or "0"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r} is not one of {', '.join(MODES)}")
    return value


def enabled() -> bool:
    return mode() != "0"


def for_worker(name: str) -> StreamChaos | None:
    """The chaos of the worker called ``name``, or None when chaos is off (read from the
    environment when the worker is made, so a test can switch it per engine)."""
    current = mode()
    if current == "0":
        return None
    base = int(os.environ.get(SEED_ENV, "0"))
    return StreamChaos(lazy=current == "lazy", seed=base * 1_000_003 + zlib.crc32(name.encode()))


def poison_(tensor: torch.Tensor) -> None:
    """Fill a released buffer so that a read through a missing wait is seen: NaN for floating
    point, the largest value for integers and bytes (0xFF bytes are NaN in every float dtype)."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype == torch.bool:
        tensor.fill_(True)
    else:
        tensor.fill_(torch.iinfo(tensor.dtype).max if tensor.dtype != torch.uint8 else 0xFF)
