"""The SSD activation tier's store (SSDTrain; DESIGN section 4, "Activations").

Saved activation bytes go to one file each, written by a small pool of I/O threads while forward
goes on, and are read back ahead of need in backward. The policy above (deduplication,
forwarding, version checks: ``transfers``) hands this store contiguous CPU tensors and asks for
bytes back; the store keeps the books of those files: which are queued, being written, on disk
or failed, how many bytes are in flight, which failures no caller has seen yet. It avoids the
original's flaws (PAPERS.md):

- an I/O error is never logged and ignored: it is raised on the caller's thread (``wait_written``,
  ``PendingRead.result``, the next ``write``, ``close``), and a failed read never yields zeros;
- free space can be checked up front (``check_free_space``);
- files live in one directory per store, removed however the run ends (``run_dirs``);
- after a failed step the caller can ``discard`` its files at once: a full disk gets its space
  back as soon as the error is raised, not when the store closes;
- no GPUDirect Storage is needed: the system calls (O_DIRECT or buffered I/O that drops the page
  cache behind itself, page-aligned staging, files padded to ``BLOCK_BYTES``) are ``ssd_io``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from protrain.runtime.activations.ssd_files import ActivationFile, PendingRead, WriteState
from protrain.runtime.chunks.trace_labels import job_label
from protrain.runtime.hw import run_dirs, ssd_io
from protrain.runtime.hw.ssd_io import (
    BLOCK_BYTES,
    IO_MODE_BUFFERED,
    IO_MODE_DIRECT,
    SsdIoError,
    StagingBuffers,
    io_error,
    padded,
    remove_file,
)

__all__ = [
    "BLOCK_BYTES",
    "IO_MODE_BUFFERED",
    "IO_MODE_DIRECT",
    "ActivationFile",
    "ActivationFileStore",
    "PendingRead",
    "SsdIoError",
    "StoreStats",
]

_THREAD_PREFIX = "protrain-ssd"


@dataclass(slots=True)
class StoreStats:
    """Counters of one store. ``bytes_written``/``bytes_read`` count payload bytes (the tensors'
    own sizes); ``bytes_on_disk`` sums the sizes of the files the store holds, which under O_DIRECT
    are padded to ``BLOCK_BYTES``. The seconds are busy time summed over the I/O threads."""

    bytes_written: int = 0
    bytes_read: int = 0
    files_written: int = 0
    files_read: int = 0
    writes_cancelled: int = 0
    peak_inflight_bytes: int = 0
    bytes_on_disk: int = 0
    peak_bytes_on_disk: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0


class ActivationFileStore:
    """Asynchronous activation files in ``run_dir = root / protrain-act-{host}-{pid}-rank{rank}``
    (``...-rank{rank}-2``, ``-3`` for further stores of this process and rank: two engines alive
    at once, each with its own directory).

    ``write`` queues a tensor's bytes and returns at once; ``read`` starts a prefetch (waiting for
    the write if it is still going); ``release`` unlinks a file or cancels a write not yet started.
    Queued plus in-flight write bytes are held under ``max_inflight_bytes`` by blocking ``write``,
    so a fast forward cannot pile up unbounded host memory in front of a slow disk.

    Reads and writes share one FIFO thread pool. A read is always submitted after the write of the
    same file, so by the time a read job starts the write has started on another thread or
    finished: a read job waiting for its write cannot deadlock the pool.

    ``direct_io``: None probes O_DIRECT in ``run_dir``; True requires it; False forces buffered
    I/O. ``staging_chunk_bytes``: size of each staging buffer; larger payloads go in pieces.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        rank: int,
        max_inflight_bytes: int = 256 << 20,
        io_workers: int = 2,
        checksum: bool = False,
        direct_io: bool | None = None,
        staging_chunk_bytes: int = 8 << 20,
    ) -> None:
        _check_arguments(rank, max_inflight_bytes, io_workers, staging_chunk_bytes)
        self.max_inflight_bytes = max_inflight_bytes
        self.checksum = checksum
        self.run_dir = run_dirs.create_run_dir(Path(root), rank)
        self._executor = ThreadPoolExecutor(io_workers, thread_name_prefix=_THREAD_PREFIX)
        # Registered before anything else can fail, so the directory goes however this store ends.
        self._finalizer = weakref.finalize(self, _shut_down, self._executor, self.run_dir, os.getpid())
        self._staging = StagingBuffers(io_workers, staging_chunk_bytes)
        try:
            self.direct_io = ssd_io.choose_direct_io(direct_io, self.run_dir, self._staging)
        except BaseException:
            self._finalizer()
            raise
        self.io_mode = IO_MODE_DIRECT if self.direct_io else IO_MODE_BUFFERED
        # Entered through the RLock, whose __enter__ is C: a KeyboardInterrupt cannot land between
        # its acquire and the block (Condition.__enter__ is Python code, where one can, leaving
        # the lock held; the I/O threads then wait for it forever and the exit hangs on them).
        self._mutex = threading.RLock()
        self._lock = threading.Condition(self._mutex)
        self._stats = StoreStats()
        self._inflight_bytes = 0
        self._next_index = 0
        self._live: dict[Path, ActivationFile] = {}  # written or queued, not yet released
        self._unreported: list[ActivationFile] = []  # failed writes not yet raised to a caller
        self._closed = False

    # -- public API ---------------------------------------------------------------------------

    @property
    def stats(self) -> StoreStats:
        """A consistent snapshot of the counters."""
        with self._mutex:
            return dataclasses.replace(self._stats)

    def write(self, data: torch.Tensor, *, block: int = 0) -> ActivationFile:
        """Queue ``data``'s bytes for a new file and return at once. ``data`` must stay unmodified
        until ``written()``. Blocks while the in-flight bytes would exceed ``max_inflight_bytes``
        (unless nothing is in flight); raises a still unreported failure of an earlier write.
        ``block``: whose activation this is, the number of the file's write and read in a trace."""
        payload = ssd_io.as_bytes(data)
        nbytes = payload.numel()
        with self._mutex:
            self._lock.wait_for(lambda: self._may_queue(nbytes))
            self._check_open()
            error = self._take_pending_failure()
            if error is not None:
                raise error
            path = self.run_dir / f"{self._next_index:08d}.act"
            self._next_index += 1
            disk_bytes = padded(nbytes) if self.direct_io else nbytes
            file = ActivationFile(path, nbytes, disk_bytes, payload, self._mutex, block=block)
            self._live[path] = file
            self._inflight_bytes += nbytes
            self._stats.peak_inflight_bytes = max(self._stats.peak_inflight_bytes, self._inflight_bytes)
            self._executor.submit(self._write_job, file)
        return file

    def read(self, file: ActivationFile) -> PendingRead:
        """Start reading ``file`` back (a prefetch); the write is awaited on an I/O thread."""
        with self._mutex:
            self._check_open()
            if self._live.get(file.path) is not file:
                raise ValueError(f"{file!r} is not a live file of this store (released, or another store's)")
            future = self._executor.submit(self._read_job, file)
        return PendingRead(file, future)

    def release(self, file: ActivationFile) -> None:
        """``file`` is no longer needed: unlink it, cancel its write if not yet started, or unlink
        it when its write finishes. A pending read of a released file fails. Idempotent."""
        with self._mutex:
            if file._released or self._live.get(file.path) is not file:
                return
            file._released = True
            del self._live[file.path]
            if file._state is WriteState.QUEUED:
                self._cancel(file, None)
                return
            if file._state is not WriteState.WRITTEN:
                return  # writing: its job unlinks it; failed or cancelled: nothing on disk
            self._stats.bytes_on_disk -= file.disk_bytes
        remove_file(file.path)

    def discard(self, files: Iterable[ActivationFile]) -> None:
        """Release ``files`` and return once none of them takes space on disk: a write still
        running is awaited (its job unlinks the file). For a step that failed (a full disk):
        its files can never be read, and the caller gets their space back at once. A file that
        cannot be unlinked stays until ``close``; the step's own error is the news."""
        files = list(files)
        for file in files:
            with contextlib.suppress(OSError):
                self.release(file)
        for file in files:
            file._done.wait()

    def check_free_space(self, nbytes: int) -> None:
        """Raise ``SsdIoError`` when the filesystem of ``run_dir`` has fewer than ``nbytes`` free."""
        ssd_io.check_free_space(self.run_dir, nbytes)

    def close(self) -> None:
        """Cancel queued writes, wait for running I/O, remove ``run_dir``. Idempotent. Raises the
        failure of a write that no caller has seen yet (failures of released files are ignored)."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            for file in self._live.values():
                if file._state is WriteState.QUEUED:
                    self._cancel(file, SsdIoError(f"write of activation file {file.path} failed: the store was closed"))
            self._lock.notify_all()
        self._finalizer()
        with self._mutex:
            self._stats.bytes_on_disk = 0  # the directory and every file in it are gone
            error = self._take_pending_failure()
        if error is not None:
            raise error

    def __enter__(self) -> ActivationFileStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @staticmethod
    def remove_stale(root: str | os.PathLike[str]) -> list[Path]:
        """Remove this host's run directories under ``root`` that no live store owns (crashed
        runs'); see ``run_dirs.remove_stale``."""
        return run_dirs.remove_stale(root)

    # -- caller-side helpers (lock held) -------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the activation store in {self.run_dir} is closed")

    def _may_queue(self, nbytes: int) -> bool:
        return (
            self._closed
            or self._has_pending_failure()
            or self._inflight_bytes == 0
            or self._inflight_bytes + nbytes <= self.max_inflight_bytes
        )

    def _has_pending_failure(self) -> bool:
        """A failed write no caller has been told about and that is still wanted exists."""
        self._unreported = [f for f in self._unreported if not (f._reported or f._released)]
        return bool(self._unreported)

    def _take_pending_failure(self) -> SsdIoError | None:
        """The error of the first such write, which counts as told from now on."""
        if not self._has_pending_failure():
            return None
        file = self._unreported.pop(0)
        file._reported = True
        return file._error

    def _cancel(self, file: ActivationFile, error: SsdIoError | None) -> None:
        """A queued write will not run; its job, when it comes up, sees the state and returns."""
        file._state = WriteState.CANCELLED
        file._error = error
        file._payload = None
        self._inflight_bytes -= file.nbytes
        self._stats.writes_cancelled += 1
        file._done.set()
        self._lock.notify_all()

    # -- I/O threads ---------------------------------------------------------------------------

    def _write_job(self, file: ActivationFile) -> None:
        with self._mutex:
            if file._state is not WriteState.QUEUED:
                return
            file._state = WriteState.WRITING
            payload = file._payload
        assert payload is not None
        started = time.perf_counter()
        error: SsdIoError | None = None
        crc32 = 0
        try:
            with job_label("ssd_write", file.block):
                crc32 = self._write_file(file.path, payload)
        except Exception as err:  # noqa: BLE001 - handed to the caller's thread, never swallowed
            error = io_error("write", file.path, err)
            # Never leave a partial file behind; should even the unlink fail, close() removes it.
            with contextlib.suppress(OSError):
                remove_file(file.path)
        elapsed_s = time.perf_counter() - started
        with self._mutex:
            self._finish_write(file, crc32, error, elapsed_s)

    def _finish_write(self, file: ActivationFile, crc32: int, error: SsdIoError | None, elapsed_s: float) -> None:
        """Record a finished write (lock held). A file released while it was being written is
        unlinked here, before ``written()`` turns true, so no caller ever sees it on disk after."""
        self._inflight_bytes -= file.nbytes
        self._stats.write_seconds += elapsed_s
        file._payload = None
        if error is not None:
            file._state = WriteState.FAILED
            file._error = error
            if not file._released:
                self._unreported.append(file)
        else:
            file._state = WriteState.WRITTEN
            file._crc32 = crc32
            self._stats.bytes_written += file.nbytes
            self._stats.files_written += 1
            if file._released:
                with contextlib.suppress(OSError):  # nobody left to tell; close() removes the directory
                    remove_file(file.path)
            else:
                self._stats.bytes_on_disk += file.disk_bytes
                self._stats.peak_bytes_on_disk = max(self._stats.peak_bytes_on_disk, self._stats.bytes_on_disk)
        file._done.set()
        self._lock.notify_all()

    def _write_file(self, path: Path, payload: torch.Tensor) -> int:
        """Write ``payload`` through a staging buffer in aligned pieces; returns its crc32."""
        return ssd_io.write_file(path, payload, self._staging, direct_io=self.direct_io, checksum=self.checksum)

    def _read_job(self, file: ActivationFile) -> torch.Tensor:
        file._done.wait()
        with self._mutex:
            state, cause = file._state, file._error
        if state is not WriteState.WRITTEN:
            why = str(cause) if cause is not None else "it was released before it was written"
            raise SsdIoError(f"read of activation file {file.path} failed: {why}") from cause
        started = time.perf_counter()
        try:
            with job_label("ssd_read", file.block):
                result, crc32 = ssd_io.read_file(
                    file.path,
                    file.nbytes,
                    file.disk_bytes,
                    self._staging,
                    direct_io=self.direct_io,
                    checksum=self.checksum,
                )
        except SsdIoError:
            raise
        except Exception as err:  # noqa: BLE001 - handed to the caller's thread via the future
            raise io_error("read", file.path, err) from err
        if self.checksum and crc32 != file._crc32:
            raise SsdIoError(
                f"read of activation file {file.path} failed: checksum mismatch (crc32 {crc32:#010x} read, "
                f"{file._crc32:#010x} written): the file was changed on disk"
            )
        with self._mutex:
            self._stats.read_seconds += time.perf_counter() - started
            self._stats.bytes_read += file.nbytes
            self._stats.files_read += 1
        return result


def _check_arguments(rank: int, max_inflight_bytes: int, io_workers: int, staging_chunk_bytes: int) -> None:
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if max_inflight_bytes <= 0:
        raise ValueError(f"max_inflight_bytes must be positive, got {max_inflight_bytes}")
    if io_workers < 1:
        raise ValueError(f"io_workers must be >= 1, got {io_workers}")
    if staging_chunk_bytes <= 0 or staging_chunk_bytes % BLOCK_BYTES:
        raise ValueError(f"staging_chunk_bytes must be a positive multiple of {BLOCK_BYTES}, got {staging_chunk_bytes}")


def _shut_down(executor: ThreadPoolExecutor, run_dir: Path, owner_pid: int) -> None:
    """Stop the I/O threads and remove ``run_dir``: run once, by ``close()`` or, if it was never
    called, when the store is garbage collected or the interpreter exits (after an exception or
    KeyboardInterrupt unwound past the engine)."""
    if os.getpid() != owner_pid:
        return  # a forked child inherits this finalizer, but the directory is its parent's, in use
    # A store dropped without close() can be collected on one of its own I/O threads (a job held
    # the last reference); that thread cannot join itself.
    on_io_thread = threading.current_thread().name.startswith(_THREAD_PREFIX)
    executor.shutdown(wait=not on_io_thread, cancel_futures=True)
    run_dirs.remove_run_dir(run_dir)
