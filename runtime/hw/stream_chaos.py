"""Stream chaos: a test mode that makes CPU runs show the ordering bugs CUDA would.

On CPU every side-stream job runs on a worker thread that usually finishes long before anyone
looks, so a missing wait goes unseen: the data is there by luck. ``PROTRAIN_STREAM_CHAOS`` takes
that luck away:

- ``1`` (random): every side-stream and host-worker job is delayed by a random 0-5 ms before it
  runs (one in four by 25 ms more: ``draw_delay``), from a ``random.Random`` of its own (never
  torch's generator: chaos must not change the training's random streams), seeded by
  ``PROTRAIN_STREAM_CHAOS_SEED`` (default 0) and the worker's name, so a failing seed replays;
  and a job that waits for another worker's event goes on only after another such delay
  (``DeviceEvent.wait``), so a buffer that worker reuses without its own wait is overwritten
  before the job reads it;
- ``lazy``: a job runs only once its event (or a later one of the same worker) is waited on: the
  deterministic worst case, where nothing queued ever happens early. The main thread's drains
  ask the host worker before the side stream every other time (``ChunkManager._host_first``),
  so a job of either that misses its wait for the other's work meets that work still held in
  one of every two drains;

and, in both, every buffer handed back to a pool (device chunk buffers, gradient buffers,
staging buffers, swap buffers) is filled with NaN before reuse (``poison_``), and handing back a
buffer whose event is still pending raises (``check_released``): a read through a missing wait
then yields NaN, which the equivalence tests see, and a NaN cannot hide behind
``on_nonfinite_loss: skip`` or fp16 loss scaling either: under chaos a skipped step raises
(``refuse_skipped_step``; tests that skip steps on purpose are marked ``skips_steps`` and left
out of chaos runs). ``make test-chaos`` (part of ``make test``) runs the equivalence tests that
cover every chunk plan, activation mode and precision under both modes.

Everything here costs nothing when chaos is off: pools read ``enabled()`` once when they are made.

What each mode leaves out: forward polls its swap-outs with ``query()``, which never asks for
lazily held work, and waits for them only at the end of each later offloaded block (which bounds
the bytes in flight), so under ``lazy`` the last swapped block is served from memory and its
swap-in path does not run; random delays reach a swap-in still on its way rarely (it is
prefetched blocks ahead). tests/unit/test_stream_chaos_catches.py lands the swap-outs at once to
check the swap-in's wait under lazy chaos.

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
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

ENV = "PROTRAIN_STREAM_CHAOS"
SEED_ENV = "PROTRAIN_STREAM_CHAOS_SEED"
MAX_DELAY_S = 0.005
LONG_DELAY_S = 0.025
LONG_DELAY_ODDS = 4
MODES = ("0", "1", "lazy")
SLEPT_KEPT = 4096


@dataclass(slots=True)
class StreamChaos:
    """One worker's chaos: its delays (own seeded generator) and whether it is lazy."""

    lazy: bool
    seed: int
    rng: random.Random = field(init=False)
    slept: deque[tuple[str, float]] = field(init=False, default_factory=lambda: deque(maxlen=SLEPT_KEPT))
    """The latest delays with the thread that slept each (a seed's draws, for tests to compare;
    bounded, so a long run under chaos does not grow)."""
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def delay(self) -> None:
        """Sleep the next draw (random mode; the lazy mode's delay is the wait itself)."""
        if self.lazy:
            return
        with self._lock:
            seconds = draw_delay(self.rng)
            self.slept.append((threading.current_thread().name, seconds))
        time.sleep(seconds)


def draw_delay(rng: random.Random) -> float:
    """A job's delay: 0-5 ms, and one job in ``LONG_DELAY_ODDS`` is held ``LONG_DELAY_S`` more.
    The long tail is what finds a missing wait between two workers whose jobs were queued far
    apart (a two-phase update queued at the step, the gather that must follow it queued in the
    next forward): uniform delays of a few ms kept the earlier job ahead on most seeds."""
    seconds = rng.uniform(0.0, MAX_DELAY_S)
    if rng.random() < 1.0 / LONG_DELAY_ODDS:
        seconds += LONG_DELAY_S
    return seconds


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
    point, True for bool, the largest value for integers, and 0xFF bytes for the rest (0xFF
    bytes are NaN in every float dtype, so a byte buffer viewed as floats reads NaN too)."""
    if tensor.dtype == torch.bool:
        tensor.fill_(True)
        return
    if tensor.is_floating_point() or tensor.is_complex():
        try:
            tensor.fill_(float("nan"))
            return
        except RuntimeError:  # no fill kernel (packed float4 pairs): fill their bytes below
            pass
    elif tensor.dtype in _INTEGERS:
        tensor.fill_(torch.iinfo(tensor.dtype).max)
        return
    tensor.view(torch.uint8).fill_(0xFF)


_INTEGERS = frozenset(
    {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64}
)


class PendingEvent(Protocol):
    """What ``check_released`` needs of an event (``runtime.hw.device.DeviceEvent``; the device
    layer imports this module, so the type is structural)."""

    def query(self) -> bool: ...


class StreamChaosError(RuntimeError):
    """Stream chaos saw what a missing wait leads to: a buffer handed back while work still
    uses it, or a step skipped (NaN through a missed wait can show up as either)."""


def check_released(event: PendingEvent | None, what: str) -> None:
    """Raise if ``event`` (the last work that reads or writes a buffer being handed back) has not
    finished: the buffer would be reused, poisoned or freed under that work. Call only under
    chaos, once the caller's own wait for ``event`` should have happened."""
    if event is not None and not event.query():
        raise StreamChaosError(
            f"stream chaos: {what} was handed back while work on it was still pending (a wait for its event is missing)"
        )


def refuse_skipped_step(reason: str) -> None:
    """Under chaos a skipped step fails the run: NaN read through a missing wait would
    otherwise pass as a non-finite loss or an fp16 overflow and be skipped quietly."""
    if enabled():
        raise StreamChaosError(
            f"stream chaos: a step was skipped ({reason}); runs under {ENV} must skip none "
            "(a NaN read through a missing wait looks like this). A test that skips steps on "
            "purpose is marked skips_steps and left out of chaos runs"
        )
