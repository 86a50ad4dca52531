"""The system calls under the NVMe tier's files (nvme_state.py's state, nvme_grads.py's gradients):
preallocated files read and written in place at 4 KiB-aligned offsets, straight from and into
page-aligned host memory (O_DIRECT where the filesystem allows it; else buffered I/O that makes
each write durable and drops the page cache behind itself). Every failure is an ``SsdIoError``
naming the file and the cause; a read that comes back short is an error, never zeros."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from protrain.runtime.hw.device import DeviceEvent
from protrain.runtime.hw.ssd_io import SsdIoError

_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass(slots=True)
class TierFile:
    """One preallocated file of the tier and what it holds."""

    path: Path
    what: str
    """What the file holds, for messages ("optimizer state file")."""
    numel: int
    """This rank's real elements of the chunk (each tensor's length)."""
    fd: int
    slot: int
    """The host buffer the file's tensors pass through."""


@dataclass(slots=True)
class NvmeCounters:
    """Bytes the tier moved since the engine started (the figures a benchmark compares)."""

    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0


def create_file(path: Path, size: int, *, what: str, numel: int, slot: int, direct_io: bool) -> TierFile:
    """A new file of ``size`` bytes, its blocks reserved now (a later write overwrites them and
    cannot find the disk full); ``SsdIoError`` that says how to make room."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (_O_DIRECT if direct_io else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as err:
        raise SsdIoError(err.errno, f"cannot create {what} {path}: {err.strerror}") from err
    if size > 0:  # none for a rank that holds none of the chunk (its shard is padding)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as err:
            os.close(fd)
            raise SsdIoError(
                err.errno,
                f"cannot reserve {size:,} bytes for {what} {path}: {err.strerror}; free some space, "
                "point memory.ssd.path at a larger disk or lower memory.ssd.n_optimizer",
            ) from err
    return TierFile(path=path, what=what, numel=numel, fd=fd, slot=slot)


def host_view(tensor: torch.Tensor, length: int) -> memoryview:
    """``length`` bytes of host memory from ``tensor``'s start (page-aligned) for the system calls."""
    return memoryview((ctypes.c_char * length).from_address(tensor.data_ptr())).cast("B")


def read_into(tier_file: TierFile, view: memoryview, offset: int) -> None:
    done = 0
    try:
        while done < len(view):
            count = os.preadv(tier_file.fd, [view[done:]], offset + done)
            if count == 0:
                raise SsdIoError(
                    errno.EIO,
                    f"read of {tier_file.what} {tier_file.path} failed: it ends at byte "
                    f"{offset + done:,} (truncated by someone else?)",
                )
            done += count
    except SsdIoError:
        raise
    except OSError as err:
        raise SsdIoError(err.errno, f"read of {tier_file.what} {tier_file.path} failed: {err.strerror}") from err


def write_from(tier_file: TierFile, view: memoryview, offset: int) -> None:
    done = 0
    try:
        while done < len(view):
            count = os.pwrite(tier_file.fd, view[done:], offset + done)
            if count == 0:
                raise OSError(errno.EIO, "the device accepted no bytes")
            done += count
    except OSError as err:
        raise SsdIoError(err.errno, f"write of {tier_file.what} {tier_file.path} failed: {err.strerror}") from err


def read_tensors(tier_file: TierFile, tensors: Sequence[torch.Tensor], length: int, *, direct_io: bool) -> None:
    """The file into ``tensors``: ``length`` bytes each, tensor k from offset k x ``length``
    (buffered I/O: the pages dropped after)."""
    for k, tensor in enumerate(tensors):
        read_into(tier_file, host_view(tensor, length), k * length)
    if not direct_io:
        drop_cache(tier_file.fd)


def write_tensors(tier_file: TierFile, tensors: Sequence[torch.Tensor], length: int, *, direct_io: bool) -> None:
    """``tensors`` into the file as ``read_tensors`` reads them (buffered I/O: made durable, then
    the pages dropped)."""
    for k, tensor in enumerate(tensors):
        write_from(tier_file, host_view(tensor, length), k * length)
    if not direct_io:
        flush(tier_file)


def flush(tier_file: TierFile) -> None:
    """Buffered I/O: make the write durable, then drop its pages (the page cache would hold the
    bytes the tier exists to keep out of memory)."""
    try:
        os.fdatasync(tier_file.fd)
    except OSError as err:
        raise SsdIoError(err.errno, f"write of {tier_file.what} {tier_file.path} failed: {err.strerror}") from err
    drop_cache(tier_file.fd)


def drop_cache(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def wait_io(event: DeviceEvent) -> None:
    """Wait for an I/O job; its ``SsdIoError`` (the path and the cause) is what the caller sees."""
    try:
        event.wait()
    except RuntimeError as err:
        cause = err.__cause__
        if isinstance(cause, SsdIoError):
            raise cause from None
        raise
