"""What an ``SsdIoError`` does to a step's activations (DESIGN section 4, "Activations").

An ``SsdIoError`` (a full disk, a failed read) ends the step. Before it reaches the caller, every
ssd activation not yet back in memory is dropped and its file removed, waiting out writes still
running: they belong to the failed pass (or to a graph whose backward would need the same disk),
could never be read again, and a user who catches the error has the disk space back at once.
The store stays open: once space is freed, the next forward writes files again. Backward
through a graph whose activations were dropped raises ``SsdIoError`` saying so (the record's
``lost`` message).

``drops_files_on_io_error`` marks the dispatcher's entry points (autograd's pack and unpack hooks,
the block and phase boundaries) where such an error can surface; ``drop_unread_files`` is what it
does first.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from protrain.profiler.plan import BlockMode
from protrain.runtime.activations.records import StoredStorage
from protrain.runtime.activations.ssd_store import ActivationFile, ActivationFileStore, PendingRead, SsdIoError
from protrain.runtime.activations.transfers import ActivationTransfers

_Result = TypeVar("_Result")


class _DropsFiles(Protocol):
    def _drop_files(self, error: SsdIoError) -> None: ...


def drops_files_on_io_error(method: Callable[..., _Result]) -> Callable[..., _Result]:
    """``method`` of ``ActivationManager``: an ``SsdIoError`` it raises first drops the step's
    activation files (see the module docstring), then goes on to the caller."""

    @functools.wraps(method)
    def guarded(self: _DropsFiles, *args: Any, **kwargs: Any) -> _Result:
        try:
            return method(self, *args, **kwargs)
        except SsdIoError as err:
            self._drop_files(err)
            raise

    return guarded


@dataclass(slots=True)
class DroppedFiles:
    """What ``drop_unread_files`` gave up, to finish once the dispatcher's lock is released."""

    records: list[StoredStorage]
    files: list[ActivationFile]
    reads: list[PendingRead]

    def settle(self, store: ActivationFileStore) -> None:
        """Return once none of the files takes space on disk: a write still running is awaited,
        a read in flight too (an open file keeps its blocks)."""
        store.discard(self.files)
        for read in self.reads:
            with contextlib.suppress(SsdIoError):  # its file is gone: it fails, or it had finished
                read.result()


def drop_unread_files(
    records: Iterable[StoredStorage], error: SsdIoError, transfers: ActivationTransfers
) -> DroppedFiles:
    """Give up every ssd record among ``records`` whose bytes are not back in memory (lock held):
    each is marked lost for ``error`` and its host bytes freed; its file and read in flight are
    handed back for ``DroppedFiles.settle``."""
    doomed = [
        record for record in records if record.mode is BlockMode.SSD and record.restored is None and record.lost is None
    ]
    dropped = DroppedFiles(
        records=doomed,
        files=[record.file for record in doomed if record.file is not None],
        reads=[record.inbound for record in doomed if isinstance(record.inbound, PendingRead)],
    )
    for record in doomed:
        _forget(record, error, transfers)
    return dropped


def _forget(record: StoredStorage, error: SsdIoError, transfers: ActivationTransfers) -> None:
    """``record``'s bytes are given up (lock held; its file is the caller's to discard)."""
    record.lost = (
        f"the saved activations of block {record.block} were dropped when a step failed on an "
        f"I/O error ({error}); run the forward again (after freeing space on a full disk)"
    )
    record.file = None
    record.inbound = None
    if record.outbound is not None:
        with contextlib.suppress(Exception):  # a failed staging copy: the I/O error is the news
            record.outbound.wait()  # it writes into the host buffer freed below
        record.outbound = None
    transfers.free_host(record)
    record.source = None
