"""The handles a caller holds for the SSD activation tier: an ``ActivationFile`` per saved
tensor's bytes, a ``PendingRead`` per prefetch. ``ActivationFileStore`` (``ssd_store``) creates
them and moves their writes through ``WriteState``; a caller only asks whether the bytes are on
disk yet, waits for them, and collects a read, and sees a failure as ``SsdIoError`` on its own
thread.
"""

from __future__ import annotations

import enum
import threading
from concurrent.futures import CancelledError, Future
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from protrain.runtime.hw.ssd_io import SsdIoError


class WriteState(enum.Enum):
    """Where a file's write is: queued -> writing -> written or failed; a queued write may be
    cancelled (released, or the store closed) and then never runs."""

    QUEUED = "queued"
    WRITING = "writing"
    WRITTEN = "written"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ActivationFile:
    """One saved tensor's bytes on disk, returned by ``ActivationFileStore.write``.

    Callers use ``nbytes``, ``path``, ``block``, ``written`` and ``wait_written``; the rest is the store's
    bookkeeping, kept here rather than in a side table so nothing has to be kept in sync. Every
    field is read and changed under the owning store's lock, by the store only (``ssd_store``).
    """

    __slots__ = (
        "nbytes",
        "path",
        "block",
        "disk_bytes",
        "_lock",
        "_done",
        "_state",
        "_payload",
        "_error",
        "_reported",
        "_released",
        "_crc32",
    )

    def __init__(
        self,
        path: Path,
        nbytes: int,
        disk_bytes: int,
        payload: torch.Tensor,
        lock: AbstractContextManager[Any],
        *,
        block: int = 0,
    ) -> None:
        self.nbytes = nbytes
        self.path = path
        self.block = block
        """The block whose saved tensor this is (a trace labels the file's write and read by it)."""
        self.disk_bytes = disk_bytes
        self._lock = lock
        self._done = threading.Event()
        self._state = WriteState.QUEUED
        self._payload: torch.Tensor | None = payload  # keeps the caller's bytes alive until written
        self._error: SsdIoError | None = None
        self._reported = False  # the error was raised on a caller's thread
        self._released = False
        self._crc32 = 0

    def written(self) -> bool:
        """The write has finished, successfully or not (or was cancelled); does not block."""
        return self._done.is_set()

    def wait_written(self) -> None:
        """Block until the write has finished; raise ``SsdIoError`` if it failed."""
        self._done.wait()
        with self._lock:
            error = self._error
            if error is not None:
                self._reported = True
        if error is not None:
            raise error

    def __repr__(self) -> str:
        return f"ActivationFile({str(self.path)!r}, nbytes={self.nbytes}, state={self._state.value})"


class PendingRead:
    """A read in flight (a prefetch). ``result()`` hands over the bytes or raises."""

    __slots__ = ("_file", "_future")

    def __init__(self, file: ActivationFile, future: Future[torch.Tensor]) -> None:
        self._file = file
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> torch.Tensor:
        """Block; a fresh uint8 CPU tensor of exactly ``nbytes``, or ``SsdIoError``."""
        try:
            return self._future.result()
        except CancelledError as err:
            raise SsdIoError(f"read of activation file {self._file.path} failed: the store was closed") from err
        except SsdIoError:
            with self._file._lock:
                if self._file._state is WriteState.FAILED:
                    self._file._reported = True  # the write's failure has now reached the caller
            raise
