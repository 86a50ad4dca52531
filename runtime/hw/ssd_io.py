"""How activation bytes reach the disk and come back: the system calls under ``ActivationFileStore``.

No GPUDirect Storage is needed: O_DIRECT where the filesystem allows it, else buffered I/O that
drops the page cache behind itself, since cached pages would only move the "saved" activation
memory from the process into the kernel. O_DIRECT needs the buffer address, the file offset and
the length to be multiples of the logical block size, so bytes pass through page-aligned
``StagingBuffers`` carved from an anonymous mmap, and each file is padded to ``BLOCK_BYTES``; the
caller keeps the true length.

Every failure is an ``SsdIoError`` naming the path, the operation and the cause; a short file is
an error, never zeros. Nothing here keeps state between calls: the store decides what to write,
when, and on which thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import queue
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

BLOCK_BYTES = 4096
"""O_DIRECT alignment of buffer addresses, file offsets and lengths: NVMe and SATA drives have
512- or 4096-byte logical blocks, and 4096 satisfies both."""

IO_MODE_DIRECT = "O_DIRECT"
IO_MODE_BUFFERED = "buffered + fadvise(DONTNEED)"

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; elsewhere only the buffered path exists
_FADVISE = getattr(os, "posix_fadvise", None)


class SsdIoError(OSError):
    """An activation file could not be written or read; the message names the path, the
    operation and the cause."""


class StagingBuffers:
    """Page-aligned I/O buffers carved from one anonymous mmap (O_DIRECT needs aligned memory and
    an anonymous mapping starts on a page boundary), one per I/O thread so a job never waits for
    one. Never closed explicitly: the mapping goes when the last view of it does."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, count * nbytes)
        whole = memoryview(self._map)
        self._views = [whole[i * nbytes : (i + 1) * nbytes] for i in range(count)]
        self._tensors = [
            torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=i * nbytes) for i in range(count)
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


# -- one file's bytes ------------------------------------------------------------------------------


def write_file(path: Path, payload: torch.Tensor, staging: StagingBuffers, *, direct_io: bool, checksum: bool) -> int:
    """Write ``payload`` (flat uint8) to a new file through ``staging`` in aligned pieces; returns
    its crc32 (0 without ``checksum``)."""
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | (_O_DIRECT if direct_io else 0)
    fd = os.open(path, flags, 0o600)
    crc32 = 0
    try:
        with staging.borrow() as (buffer, view):
            for offset in range(0, payload.numel(), staging.nbytes):
                n = min(staging.nbytes, payload.numel() - offset)
                _copy_bytes(buffer[:n], payload[offset : offset + n])
                length = padded(n) if direct_io else n
                buffer[n:length].zero_()  # padding: zeros rather than an older tensor's bytes
                if checksum:
                    crc32 = zlib.crc32(view[:n], crc32)
                _pwrite_all(fd, view[:length], offset)
        if not direct_io:
            os.fdatasync(fd)  # dirty pages cannot be dropped from the cache
            _drop_cache(fd)
    finally:
        os.close(fd)
    return crc32


def read_file(
    path: Path,
    nbytes: int,
    disk_bytes: int,
    staging: StagingBuffers,
    *,
    direct_io: bool,
    checksum: bool,
) -> tuple[torch.Tensor, int]:
    """Read the ``nbytes`` true bytes of a file of ``disk_bytes`` (padded) into a fresh uint8
    tensor, through ``staging``; returns it and its crc32 (0 without ``checksum``)."""
    result = torch.empty(nbytes, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY | (_O_DIRECT if direct_io else 0))
    crc32 = 0
    try:
        size_bytes = os.fstat(fd).st_size
        if size_bytes < disk_bytes:
            raise SsdIoError(
                errno.EIO,
                f"read of activation file {path} failed: it has {size_bytes:,} bytes but "
                f"{disk_bytes:,} were written (truncated by someone else?)",
            )
        with staging.borrow() as (buffer, view):
            for offset in range(0, nbytes, staging.nbytes):
                n = min(staging.nbytes, nbytes - offset)
                length = padded(n) if direct_io else n
                _pread_exactly(fd, view[:length], offset, path, disk_bytes)
                if checksum:
                    crc32 = zlib.crc32(view[:n], crc32)
                _copy_bytes(result[offset : offset + n], buffer[:n])
        if not direct_io:
            _drop_cache(fd)
    finally:
        os.close(fd)
    return result, crc32


def remove_file(path: Path) -> None:
    """Unlink ``path``; already gone is fine, any other failure is an ``SsdIoError``."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as err:
        raise io_error("removal", path, err) from err


def io_error(operation: str, path: Path, cause: BaseException) -> SsdIoError:
    """``cause`` as the ``SsdIoError`` a caller sees: the operation, the path, the reason."""
    if isinstance(cause, SsdIoError):
        return cause
    if isinstance(cause, OSError) and cause.errno is not None:
        return SsdIoError(cause.errno, f"{operation} of activation file {path} failed: {cause.strerror}")
    return SsdIoError(f"{operation} of activation file {path} failed: {cause!r}")


def as_bytes(data: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as a flat uint8 view (any dtype, including bool and bf16)."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(data).__name__}")
    if data.device.type != "cpu" or data.layout != torch.strided or not data.is_contiguous():
        raise ValueError(
            f"activation files take contiguous dense CPU tensors, got device={data.device}, "
            f"layout={data.layout}, contiguous={data.is_contiguous()}; copy it to one first"
        )
    return data.detach().reshape(-1).view(torch.uint8)


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to whole ``BLOCK_BYTES``: a file's size on disk under O_DIRECT."""
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


# -- the filesystem ---------------------------------------------------------------------------------


def check_free_space(
    directory: Path, nbytes: int, *, what: str = "activation files", knob: str = "memory.ssd.n_offload"
) -> None:
    """Raise ``SsdIoError`` when the filesystem of ``directory`` has fewer than ``nbytes`` free
    (for ``what``, which ``knob`` sizes)."""
    try:
        stat = os.statvfs(directory)
    except OSError as err:
        raise SsdIoError(err.errno, f"cannot query free space of {directory}: {err.strerror}") from err
    free_bytes = stat.f_bavail * stat.f_frsize
    if free_bytes < nbytes:
        raise SsdIoError(
            errno.ENOSPC,
            f"not enough free space for {what} in {directory}: {nbytes:,} bytes needed, "
            f"{free_bytes:,} bytes free; free some space, point memory.ssd.path at a larger disk "
            f"or lower {knob}",
        )


def choose_direct_io(requested: bool | None, run_dir: Path, staging: StagingBuffers) -> bool:
    """Whether to use O_DIRECT in ``run_dir``: False forces buffered I/O, None takes O_DIRECT
    where the filesystem allows it, True requires it."""
    if requested is False:
        return False
    supported = _probe_direct_io(run_dir, staging)
    if requested and not supported:
        raise SsdIoError(f"O_DIRECT was required but the filesystem of {run_dir} refuses it")
    return supported


def measure_disk_rates(
    directory: str | os.PathLike[str], *, nbytes: int = 256 << 20, chunk_bytes: int = 8 << 20
) -> tuple[float, float, str]:
    """(write bytes/s, read bytes/s, io mode) of the filesystem under ``directory``, the way the
    store does I/O: O_DIRECT from page-aligned buffers where allowed, else buffered writes made
    durable with fsync and reads after the page cache was dropped, so neither figure is the page
    cache's. One file of ``nbytes`` in ``chunk_bytes`` pieces, removed afterwards."""
    if nbytes <= 0 or chunk_bytes <= 0 or chunk_bytes % BLOCK_BYTES:
        raise ValueError(f"nbytes > 0 and chunk_bytes a positive multiple of {BLOCK_BYTES} needed")
    nbytes = padded(nbytes)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    staging = StagingBuffers(1, chunk_bytes)
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


def _probe_direct_io(run_dir: Path, staging: StagingBuffers) -> bool:
    """``_probe_direct_io_at`` on a probe file in the run directory, errors naming the path."""
    path = run_dir / ".direct-io-probe"
    try:
        return _probe_direct_io_at(path, staging)
    except OSError as err:
        raise io_error("O_DIRECT probe write", path, err) from err
    finally:
        with contextlib.suppress(OSError):
            remove_file(path)


def _probe_direct_io_at(path: Path, staging: StagingBuffers) -> bool:
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


# -- system calls -------------------------------------------------------------------------------------


def _copy_bytes(target: torch.Tensor, source: torch.Tensor) -> None:
    """A single-threaded memcpy with the GIL released (ctypes releases it). ``Tensor.copy_`` would
    split a large copy over intra-op threads, and on an I/O thread that starts a second OpenMP
    team that competes for cores with the training thread's own."""
    assert target.numel() == source.numel() and target.dtype == source.dtype == torch.uint8
    ctypes.memmove(target.data_ptr(), source.data_ptr(), source.numel())


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        count = os.pwrite(fd, view[done:], offset + done)
        if count == 0:
            raise OSError(errno.EIO, "the device accepted no bytes")
        done += count


def _pread_exactly(fd: int, view: memoryview, offset: int, path: Path, disk_bytes: int) -> None:
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            raise SsdIoError(
                errno.EIO,
                f"read of activation file {path} failed: it ends at byte {offset + done:,} but "
                f"{disk_bytes:,} bytes were written (truncated by someone else?)",
            )
        done += count


def _drop_cache(fd: int) -> None:
    if _FADVISE is not None:
        _FADVISE(fd, 0, 0, os.POSIX_FADV_DONTNEED)
