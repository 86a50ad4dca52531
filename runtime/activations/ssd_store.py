"""The file layer of the SSD activation tier (SSDTrain; DESIGN section 4, "Activations").

Saved activation bytes go to one file each, written by a small pool of I/O threads while forward
goes on, and are read back ahead of need in backward. The policy above (deduplication,
forwarding, version checks) hands this store contiguous CPU tensors and asks for bytes back; this
module only moves bytes and makes every failure loud. It avoids the original's flaws (PAPERS.md):

- an I/O error is never logged and ignored: it is raised on the caller's thread (``wait_written``,
  ``PendingRead.result``, the next ``write``, ``close``), and a failed read never yields zeros;
- free space can be checked up front (``check_free_space``);
- files live in one directory per store, named for its host, process and rank (a second store of
  the same process and rank, say a teacher's beside a student's, gets ``-2``, then ``-3``),
  removed by ``close``, at interpreter exit or garbage collection, and after a crash by the next
  store created on the same root;
- after a failed step the caller can ``discard`` its files at once: a full disk gets its space
  back as soon as the error is raised, not when the store closes;
- no GPUDirect Storage is needed: O_DIRECT where the filesystem allows it, else buffered I/O that
  drops the page cache behind itself, since cached pages would only move the "saved" activation
  memory from the process into the kernel.

O_DIRECT needs the buffer address, the file offset and the length to be multiples of the logical
block size, so bytes pass through page-aligned staging buffers carved from an anonymous mmap, and
each file is padded to ``BLOCK_BYTES``; the true length is kept in its ``ActivationFile``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import errno
import itertools
import mmap
import os
import queue
import re
import shutil
import socket
import threading
import time
import weakref
import zlib
from collections.abc import Iterable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

BLOCK_BYTES = 4096
"""O_DIRECT alignment of buffer addresses, file offsets and lengths: NVMe and SATA drives have
512- or 4096-byte logical blocks, and 4096 satisfies both."""

IO_MODE_DIRECT = "O_DIRECT"
IO_MODE_BUFFERED = "buffered + fadvise(DONTNEED)"

_THREAD_PREFIX = "protrain-ssd"
_RUN_DIR_PREFIX = "protrain-act-"
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; elsewhere only the buffered path exists
_FADVISE = getattr(os, "posix_fadvise", None)

# Run directories of the stores open in this process. A directory named for this host and pid
# that is not listed here was left by an earlier process with the same pid (a restarted container
# reuses pids), so it is stale even though its pid is alive. Reentrant: a store's finalizer takes
# the lock and garbage collection may run it on a thread that already holds it.
_LIVE_RUN_DIRS: set[Path] = set()
_LIVE_RUN_DIRS_LOCK = threading.RLock()


class SsdIoError(OSError):
    """An activation file could not be written or read; the message names the path, the
    operation and the cause."""


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


class _WriteState(enum.Enum):
    QUEUED = "queued"
    WRITING = "writing"
    WRITTEN = "written"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ActivationFile:
    """One saved tensor's bytes on disk, returned by ``ActivationFileStore.write``.

    Callers use ``nbytes``, ``path``, ``written`` and ``wait_written``; the rest is the store's
    bookkeeping, kept here rather than in a side table so nothing has to be kept in sync. Every
    field is read and changed under the owning store's lock.
    """

    __slots__ = (
        "nbytes",
        "path",
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
        self, path: Path, nbytes: int, disk_bytes: int, payload: torch.Tensor, lock: threading.Condition
    ) -> None:
        self.nbytes = nbytes
        self.path = path
        self.disk_bytes = disk_bytes
        self._lock = lock
        self._done = threading.Event()
        self._state = _WriteState.QUEUED
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
            raise SsdIoError(
                f"read of activation file {self._file.path} failed: the store was closed"
            ) from err
        except SsdIoError:
            with self._file._lock:
                if self._file._state is _WriteState.FAILED:
                    self._file._reported = True  # the write's failure has now reached the caller
            raise


class _StagingBuffers:
    """Page-aligned I/O buffers carved from one anonymous mmap (O_DIRECT needs aligned memory and
    an anonymous mapping starts on a page boundary), one per I/O thread so a job never waits for
    one. Never closed explicitly: the mapping goes when the last view of it does."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, count * nbytes)
        whole = memoryview(self._map)
        self._views = [whole[i * nbytes : (i + 1) * nbytes] for i in range(count)]
        self._tensors = [
            torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=i * nbytes)
            for i in range(count)
        ]
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(count):
            self._free.put(index)

    @contextlib.contextmanager
    def borrow(self) -> Iterator[tuple[torch.Tensor, memoryview]]:
        """One buffer as a tensor (for copies) and a memoryview (for the system calls)."""
        index = self._free.get()
        try:
            yield self._tensors[index], self._views[index]
        finally:
            self._free.put(index)


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
        self.run_dir = _create_run_dir(Path(root), rank)
        self._executor = ThreadPoolExecutor(io_workers, thread_name_prefix=_THREAD_PREFIX)
        # Registered before anything else can fail, so the directory goes however this store ends.
        self._finalizer = weakref.finalize(self, _shut_down, self._executor, self.run_dir, os.getpid())
        self._staging = _StagingBuffers(io_workers, staging_chunk_bytes)
        try:
            self.direct_io = _choose_direct_io(direct_io, self.run_dir, self._staging)
        except BaseException:
            self._finalizer()
            raise
        self.io_mode = IO_MODE_DIRECT if self.direct_io else IO_MODE_BUFFERED
        self._lock = threading.Condition()
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
        with self._lock:
            return dataclasses.replace(self._stats)

    def write(self, data: torch.Tensor) -> ActivationFile:
        """Queue ``data``'s bytes for a new file and return at once. ``data`` must stay unmodified
        until ``written()``. Blocks while the in-flight bytes would exceed ``max_inflight_bytes``
        (unless nothing is in flight); raises a still unreported failure of an earlier write."""
        payload = _as_bytes(data)
        nbytes = payload.numel()
        with self._lock:
            self._lock.wait_for(lambda: self._may_queue(nbytes))
            self._check_open()
            error = self._take_pending_failure()
            if error is not None:
                raise error
            path = self.run_dir / f"{self._next_index:08d}.act"
            self._next_index += 1
            disk_bytes = _padded(nbytes) if self.direct_io else nbytes
            file = ActivationFile(path, nbytes, disk_bytes, payload, self._lock)
            self._live[path] = file
            self._inflight_bytes += nbytes
            self._stats.peak_inflight_bytes = max(self._stats.peak_inflight_bytes, self._inflight_bytes)
            self._executor.submit(self._write_job, file)
        return file

    def read(self, file: ActivationFile) -> PendingRead:
        """Start reading ``file`` back (a prefetch); the write is awaited on an I/O thread."""
        with self._lock:
            self._check_open()
            if self._live.get(file.path) is not file:
                raise ValueError(f"{file!r} is not a live file of this store (released, or another store's)")
            future = self._executor.submit(self._read_job, file)
        return PendingRead(file, future)

    def release(self, file: ActivationFile) -> None:
        """``file`` is no longer needed: unlink it, cancel its write if not yet started, or unlink
        it when its write finishes. A pending read of a released file fails. Idempotent."""
        with self._lock:
            if file._released or self._live.get(file.path) is not file:
                return
            file._released = True
            del self._live[file.path]
            if file._state is _WriteState.QUEUED:
                self._cancel(file, None)
                return
            if file._state is not _WriteState.WRITTEN:
                return  # writing: its job unlinks it; failed or cancelled: nothing on disk
            self._stats.bytes_on_disk -= file.disk_bytes
        _remove_file(file.path)

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
        try:
            stat = os.statvfs(self.run_dir)
        except OSError as err:
            raise SsdIoError(err.errno, f"cannot query free space of {self.run_dir}: {err.strerror}") from err
        free_bytes = stat.f_bavail * stat.f_frsize
        if free_bytes < nbytes:
            raise SsdIoError(
                errno.ENOSPC,
                f"not enough free space for activation files in {self.run_dir}: {nbytes:,} bytes needed, "
                f"{free_bytes:,} bytes free; free some space, point memory.ssd.path at a larger disk "
                "or lower memory.ssd.n_offload",
            )

    def close(self) -> None:
        """Cancel queued writes, wait for running I/O, remove ``run_dir``. Idempotent. Raises the
        failure of a write that no caller has seen yet (failures of released files are ignored)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for file in self._live.values():
                if file._state is _WriteState.QUEUED:
                    self._cancel(
                        file, SsdIoError(f"write of activation file {file.path} failed: the store was closed")
                    )
            self._lock.notify_all()
        self._finalizer()
        with self._lock:
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
        """Remove this host's run directories under ``root`` that no live store owns: those of
        processes that are gone (a crashed or killed run), and those named for this process that
        none of its open stores holds (left by an earlier process with the same pid). Other live
        processes', this process's open stores' and other hosts' directories are left alone."""
        pattern = re.compile(re.escape(f"{_RUN_DIR_PREFIX}{socket.gethostname()}-") + r"(\d+)-rank\d+(-\d+)?")
        try:
            entries = sorted(Path(root).iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return []
        removed: list[Path] = []
        for entry in entries:
            match = pattern.fullmatch(entry.name)
            if match is None or entry.is_symlink() or not entry.is_dir():
                continue
            pid = int(match.group(1))
            if pid == os.getpid():
                with _LIVE_RUN_DIRS_LOCK:  # no store of ours can claim the name while it goes
                    if _held_by_this_process(entry):
                        continue
                    shutil.rmtree(entry, ignore_errors=True)
            elif _pid_alive(pid):
                continue
            else:
                shutil.rmtree(entry, ignore_errors=True)  # another rank of this host may be removing it too
            if not entry.exists():
                removed.append(entry)
        return removed

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
        file._state = _WriteState.CANCELLED
        file._error = error
        file._payload = None
        self._inflight_bytes -= file.nbytes
        self._stats.writes_cancelled += 1
        file._done.set()
        self._lock.notify_all()

    # -- I/O threads ---------------------------------------------------------------------------

    def _write_job(self, file: ActivationFile) -> None:
        with self._lock:
            if file._state is not _WriteState.QUEUED:
                return
            file._state = _WriteState.WRITING
            payload = file._payload
        assert payload is not None
        started = time.perf_counter()
        error: SsdIoError | None = None
        crc32 = 0
        try:
            crc32 = self._write_file(file.path, payload)
        except Exception as err:  # noqa: BLE001 - handed to the caller's thread, never swallowed
            error = _io_error("write", file.path, err)
            # Never leave a partial file behind; should even the unlink fail, close() removes it.
            with contextlib.suppress(OSError):
                _remove_file(file.path)
        elapsed_s = time.perf_counter() - started
        with self._lock:
            self._finish_write(file, crc32, error, elapsed_s)

    def _finish_write(
        self, file: ActivationFile, crc32: int, error: SsdIoError | None, elapsed_s: float
    ) -> None:
        """Record a finished write (lock held). A file released while it was being written is
        unlinked here, before ``written()`` turns true, so no caller ever sees it on disk after."""
        self._inflight_bytes -= file.nbytes
        self._stats.write_seconds += elapsed_s
        file._payload = None
        if error is not None:
            file._state = _WriteState.FAILED
            file._error = error
            if not file._released:
                self._unreported.append(file)
        else:
            file._state = _WriteState.WRITTEN
            file._crc32 = crc32
            self._stats.bytes_written += file.nbytes
            self._stats.files_written += 1
            if file._released:
                with contextlib.suppress(OSError):  # nobody left to tell; close() removes the directory
                    _remove_file(file.path)
            else:
                self._stats.bytes_on_disk += file.disk_bytes
                self._stats.peak_bytes_on_disk = max(
                    self._stats.peak_bytes_on_disk, self._stats.bytes_on_disk
                )
        file._done.set()
        self._lock.notify_all()

    def _write_file(self, path: Path, payload: torch.Tensor) -> int:
        """Write ``payload`` through the staging buffer in aligned pieces; returns its crc32."""
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | (_O_DIRECT if self.direct_io else 0)
        fd = os.open(path, flags, 0o600)
        crc32 = 0
        try:
            with self._staging.borrow() as (staging, view):
                for offset in range(0, payload.numel(), self._staging.nbytes):
                    n = min(self._staging.nbytes, payload.numel() - offset)
                    _copy_bytes(staging[:n], payload[offset : offset + n])
                    length = _padded(n) if self.direct_io else n
                    staging[n:length].zero_()  # padding: zeros rather than an older tensor's bytes
                    if self.checksum:
                        crc32 = zlib.crc32(view[:n], crc32)
                    _pwrite_all(fd, view[:length], offset)
            if not self.direct_io:
                os.fdatasync(fd)  # dirty pages cannot be dropped from the cache
                _drop_cache(fd)
        finally:
            os.close(fd)
        return crc32

    def _read_job(self, file: ActivationFile) -> torch.Tensor:
        file._done.wait()
        with self._lock:
            state, cause = file._state, file._error
        if state is not _WriteState.WRITTEN:
            why = str(cause) if cause is not None else "it was released before it was written"
            raise SsdIoError(f"read of activation file {file.path} failed: {why}") from cause
        started = time.perf_counter()
        try:
            result, crc32 = self._read_file(file)
        except SsdIoError:
            raise
        except Exception as err:  # noqa: BLE001 - handed to the caller's thread via the future
            raise _io_error("read", file.path, err) from err
        if self.checksum and crc32 != file._crc32:
            raise SsdIoError(
                f"read of activation file {file.path} failed: checksum mismatch (crc32 {crc32:#010x} read, "
                f"{file._crc32:#010x} written): the file was changed on disk"
            )
        with self._lock:
            self._stats.read_seconds += time.perf_counter() - started
            self._stats.bytes_read += file.nbytes
            self._stats.files_read += 1
        return result

    def _read_file(self, file: ActivationFile) -> tuple[torch.Tensor, int]:
        """Read the padded pieces into staging, copy the true bytes into a fresh tensor."""
        result = torch.empty(file.nbytes, dtype=torch.uint8)
        fd = os.open(file.path, os.O_RDONLY | (_O_DIRECT if self.direct_io else 0))
        crc32 = 0
        try:
            size_bytes = os.fstat(fd).st_size
            if size_bytes < file.disk_bytes:
                raise SsdIoError(
                    errno.EIO,
                    f"read of activation file {file.path} failed: it has {size_bytes:,} bytes but "
                    f"{file.disk_bytes:,} were written (truncated by someone else?)",
                )
            with self._staging.borrow() as (staging, view):
                for offset in range(0, file.nbytes, self._staging.nbytes):
                    n = min(self._staging.nbytes, file.nbytes - offset)
                    length = _padded(n) if self.direct_io else n
                    _pread_exactly(fd, view[:length], offset, file)
                    if self.checksum:
                        crc32 = zlib.crc32(view[:n], crc32)
                    _copy_bytes(result[offset : offset + n], staging[:n])
            if not self.direct_io:
                _drop_cache(fd)
        finally:
            os.close(fd)
        return result, crc32


# -- helpers ---------------------------------------------------------------------------------------


def measure_disk_rates(
    directory: str | os.PathLike[str], *, nbytes: int = 256 << 20, chunk_bytes: int = 8 << 20
) -> tuple[float, float, str]:
    """(write bytes/s, read bytes/s, io mode) of the filesystem under ``directory``, the way the
    store does I/O: O_DIRECT from page-aligned buffers where allowed, else buffered writes made
    durable with fsync and reads after the page cache was dropped, so neither figure is the page
    cache's. One file of ``nbytes`` in ``chunk_bytes`` pieces, removed afterwards."""
    if nbytes <= 0 or chunk_bytes <= 0 or chunk_bytes % BLOCK_BYTES:
        raise ValueError(f"nbytes > 0 and chunk_bytes a positive multiple of {BLOCK_BYTES} needed")
    nbytes = _padded(nbytes)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    staging = _StagingBuffers(1, chunk_bytes)
    path = root / f".protrain-disk-probe-{os.getpid()}-{threading.get_ident()}"
    direct = _probe_direct_io_at(path, staging)
    flags = _O_DIRECT if direct else 0
    with staging.borrow() as (tensor, view):
        tensor.fill_(0x5A)  # untouched anonymous pages could be deduplicated or zero-filled
        try:
            fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | flags, 0o600)
            try:
                started = time.perf_counter()
                for offset in range(0, nbytes, chunk_bytes):
                    _pwrite_all(fd, view[: min(chunk_bytes, nbytes - offset)], offset)
                os.fsync(fd)
                write_s = time.perf_counter() - started
                _drop_cache(fd)
            finally:
                os.close(fd)
            fd = os.open(path, os.O_RDONLY | flags)
            try:
                _drop_cache(fd)
                started = time.perf_counter()
                for offset in range(0, nbytes, chunk_bytes):
                    piece = view[: min(chunk_bytes, nbytes - offset)]
                    if os.preadv(fd, [piece], offset) != len(piece):
                        raise SsdIoError(errno.EIO, f"disk probe file {path} came back short")
                read_s = time.perf_counter() - started
            finally:
                os.close(fd)
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
    mode = IO_MODE_DIRECT if direct else IO_MODE_BUFFERED
    return nbytes / max(write_s, 1e-9), nbytes / max(read_s, 1e-9), mode


def _probe_direct_io_at(path: Path, staging: _StagingBuffers) -> bool:
    """Whether ``path``'s filesystem takes an aligned O_DIRECT write: filesystems without it (older
    tmpfs, some network and FUSE filesystems) refuse with EINVAL at open or at the first write.
    Leaves the file for the caller to remove."""
    if not _O_DIRECT:
        return False
    refused = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
    try:
        fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | _O_DIRECT, 0o600)
    except OSError as err:
        if err.errno in refused:
            return False
        raise
    try:
        with staging.borrow() as (_, view):
            _pwrite_all(fd, view[:BLOCK_BYTES], 0)
    except OSError as err:
        if err.errno in refused:
            return False
        raise
    finally:
        os.close(fd)
    return True


def _check_arguments(rank: int, max_inflight_bytes: int, io_workers: int, staging_chunk_bytes: int) -> None:
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if max_inflight_bytes <= 0:
        raise ValueError(f"max_inflight_bytes must be positive, got {max_inflight_bytes}")
    if io_workers < 1:
        raise ValueError(f"io_workers must be >= 1, got {io_workers}")
    if staging_chunk_bytes <= 0 or staging_chunk_bytes % BLOCK_BYTES:
        raise ValueError(
            f"staging_chunk_bytes must be a positive multiple of {BLOCK_BYTES}, got {staging_chunk_bytes}"
        )


def _create_run_dir(root: Path, rank: int) -> Path:
    """Make ``root`` (if needed), clear crashed runs' directories, create this store's own: the
    first name for this host, pid and rank that no open store of this process holds."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SsdIoError(
            err.errno,
            f"cannot use {root} for activation files: {err.strerror}; set memory.ssd.path to a directory",
        ) from err
    if not os.access(root, os.W_OK | os.X_OK):
        raise SsdIoError(
            f"{root} is not a writable directory; set memory.ssd.path to one this process can write"
        )
    ActivationFileStore.remove_stale(root)
    stem = root.resolve() / f"{_RUN_DIR_PREFIX}{socket.gethostname()}-{os.getpid()}-rank{rank}"
    with _LIVE_RUN_DIRS_LOCK:
        run_dir = _unused_run_dir(stem)
        # Named for our pid but held by no store of ours: left by an earlier process with this
        # pid (remove_stale cleared it unless it is new) or by a store of ours whose removal failed.
        shutil.rmtree(run_dir, ignore_errors=True)
        try:
            run_dir.mkdir()
        except OSError as err:
            raise SsdIoError(
                err.errno, f"cannot create the activation directory {run_dir}: {err.strerror}"
            ) from err
        _LIVE_RUN_DIRS.add(run_dir)
    return run_dir


def _unused_run_dir(stem: Path) -> Path:
    """``stem``, else ``stem-2``, ``stem-3``, ...: the first that no open store of this process
    holds (lock held), as run folders are numbered for a second engine of the same process."""
    for attempt in itertools.count(1):
        candidate = stem if attempt == 1 else stem.with_name(f"{stem.name}-{attempt}")
        if candidate not in _LIVE_RUN_DIRS:
            return candidate
    raise AssertionError("unreachable")


def _held_by_this_process(run_dir: Path) -> bool:
    """An open store of this process holds ``run_dir`` (lock held; the registry keeps resolved
    paths, ``run_dir`` may be spelled through a symlinked root)."""
    return run_dir.parent.resolve() / run_dir.name in _LIVE_RUN_DIRS


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
    try:
        shutil.rmtree(run_dir)
    except FileNotFoundError:
        pass
    except OSError as err:
        raise SsdIoError(
            err.errno, f"cannot remove the activation directory {run_dir}: {err.strerror}"
        ) from err
    finally:
        with _LIVE_RUN_DIRS_LOCK:
            _LIVE_RUN_DIRS.discard(run_dir)


def _choose_direct_io(requested: bool | None, run_dir: Path, staging: _StagingBuffers) -> bool:
    if requested is False:
        return False
    supported = _probe_direct_io(run_dir, staging)
    if requested and not supported:
        raise SsdIoError(f"O_DIRECT was required but the filesystem of {run_dir} refuses it")
    return supported


def _probe_direct_io(run_dir: Path, staging: _StagingBuffers) -> bool:
    """``_probe_direct_io_at`` on a probe file in the run directory, errors naming the path."""
    path = run_dir / ".direct-io-probe"
    try:
        return _probe_direct_io_at(path, staging)
    except OSError as err:
        raise _io_error("O_DIRECT probe write", path, err) from err
    finally:
        with contextlib.suppress(OSError):
            _remove_file(path)


def _as_bytes(data: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as a flat uint8 view (any dtype, including bool and bf16)."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(data).__name__}")
    if data.device.type != "cpu" or data.layout != torch.strided or not data.is_contiguous():
        raise ValueError(
            f"activation files take contiguous dense CPU tensors, got device={data.device}, "
            f"layout={data.layout}, contiguous={data.is_contiguous()}; copy it to one first"
        )
    return data.detach().reshape(-1).view(torch.uint8)


def _copy_bytes(target: torch.Tensor, source: torch.Tensor) -> None:
    """A single-threaded memcpy with the GIL released (ctypes releases it). ``Tensor.copy_`` would
    split a large copy over intra-op threads, and on an I/O thread that starts a second OpenMP
    team that competes for cores with the training thread's own."""
    assert target.numel() == source.numel() and target.dtype == source.dtype == torch.uint8
    ctypes.memmove(target.data_ptr(), source.data_ptr(), source.numel())


def _padded(nbytes: int) -> int:
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        count = os.pwrite(fd, view[done:], offset + done)
        if count == 0:
            raise OSError(errno.EIO, "the device accepted no bytes")
        done += count


def _pread_exactly(fd: int, view: memoryview, offset: int, file: ActivationFile) -> None:
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            raise SsdIoError(
                errno.EIO,
                f"read of activation file {file.path} failed: it ends at byte {offset + done:,} but "
                f"{file.disk_bytes:,} bytes were written (truncated by someone else?)",
            )
        done += count


def _drop_cache(fd: int) -> None:
    if _FADVISE is not None:
        _FADVISE(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _remove_file(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as err:
        raise _io_error("removal", path, err) from err


def _io_error(operation: str, path: Path, cause: BaseException) -> SsdIoError:
    if isinstance(cause, SsdIoError):
        return cause
    if isinstance(cause, OSError) and cause.errno is not None:
        return SsdIoError(cause.errno, f"{operation} of activation file {path} failed: {cause.strerror}")
    return SsdIoError(f"{operation} of activation file {path} failed: {cause!r}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True
