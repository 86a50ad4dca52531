"""Instruments the runtime attaches to a profiling step. They take the clock and the memory
reading as callables, so they neither import torch nor know which device they measure.

- ``BlockTimer``: forward seconds per block (and outside the blocks) from enter/exit calls.
- ``SavedBytes``: bytes saved for backward per block, each storage counted once (a tensor saved
  by several operators, or views of one buffer, are stored once).
- ``PeakSampler``: the largest reading of a memory counter, beyond what is accounted for.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

OUTSIDE = -1
"""Block index for time and bytes outside the block list."""


class BlockTimer:
    def __init__(self, clock: Callable[[], float], num_blocks: int) -> None:
        self._clock = clock
        self.forward_s = [0.0] * num_blocks
        self.outside_s = 0.0
        self._started: float | None = None
        self._current = OUTSIDE
        self._total_started: float | None = None
        self.total_s = 0.0

    def start(self) -> None:
        """The forward begins (outside any block)."""
        self._total_started = self._started = self._clock()
        self._current = OUTSIDE

    def enter(self, block: int) -> None:
        self._charge()
        self._current = block

    def exit(self, block: int) -> None:
        self._charge()
        self._current = OUTSIDE

    def stop(self) -> None:
        """The forward (and the loss) ended."""
        self._charge()
        assert self._total_started is not None
        self.total_s += self._clock() - self._total_started
        self._started = self._total_started = None

    @property
    def current(self) -> int:
        return self._current

    def _charge(self) -> None:
        now = self._clock()
        if self._started is not None:
            if self._current == OUTSIDE:
                self.outside_s += now - self._started
            else:
                self.forward_s[self._current] += now - self._started
        self._started = now


class SavedBytes:
    def __init__(self, num_blocks: int, *, where: Callable[[], int]) -> None:
        """``where()`` gives the block running now (``OUTSIDE`` between blocks)."""
        self.per_block = [0] * num_blocks
        self.outside = 0
        self._where = where
        self._seen: set[Hashable] = set()

    def record(self, storage: Hashable, num_bytes: int) -> None:
        if storage in self._seen:
            return
        self._seen.add(storage)
        block = self._where()
        if block == OUTSIDE:
            self.outside += num_bytes
        else:
            self.per_block[block] += num_bytes

    @property
    def total(self) -> int:
        return self.outside + sum(self.per_block)


class PeakSampler:
    def __init__(self, read: Callable[[], int]) -> None:
        """``read()`` returns bytes in use now (e.g. the C heap, or CUDA's allocated bytes)."""
        self._read = read
        self.base = read()
        self.peak_beyond = 0

    def sample(self, accounted: int) -> None:
        """Note the reading, less the base and ``accounted`` bytes the caller explains."""
        self.peak_beyond = max(self.peak_beyond, self._read() - self.base - accounted)
