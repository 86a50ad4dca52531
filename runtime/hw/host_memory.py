"""Host memory regions: exact-size host tensors carved from anonymous mmaps (the host tier's
chunk state, swapped activations, staging), page-locked on CUDA, and what the process holds in
them. Part of the device layer (runtime/hw/device.py), kept apart for size.

On CPU the regions are invisible to glibc's ``mallinfo2``, which then counts only what the device
tier allocates: tests measure the device tier independently of our bookkeeping.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import warnings
import weakref
from collections.abc import Callable

import torch

PAGE_BYTES = mmap.PAGESIZE


class MmapArena:
    """Host tensors carved from one anonymous mmap at page-aligned offsets.

    Exact-size allocations with no allocator rounding (PyTorch's caching host allocator rounds
    pinned blocks to powers of two), invisible to malloc statistics, freed all at once. On CUDA
    the region is page-locked with ``cudaHostRegister`` so copies from it are asynchronous.
    """

    def __init__(self, capacity_bytes: int, *, pin: bool = False, alignment: int = PAGE_BYTES) -> None:
        """``alignment``: of each allocation (pages by default: O_DIRECT reads and writes into
        swapped activations need them; chunk state asks for a cache line)."""
        self.capacity_bytes = _round_up(max(capacity_bytes, PAGE_BYTES), PAGE_BYTES)
        self.held_bytes = self.capacity_bytes
        """What the region takes: its capacity, or torch's rounded pinned block (the fallback)."""
        self.alignment = alignment
        self._map: mmap.mmap | None = mmap.mmap(-1, self.capacity_bytes)
        self._base = torch.frombuffer(self._map, dtype=torch.uint8)
        self.used_bytes = 0
        self._pinned = False
        self._unregister: Callable[[], None] | None = None
        if pin:
            error = _cuda_host_register(self._base)
            if error:
                # Some virtualised hosts refuse to lock existing pages: take page-locked memory
                # from torch's host allocator instead (rounded up to a power of two, whole).
                _clear_cuda_error()
                _warn_register_refused(error)
                del self._base
                self._map.close()
                self._map = None
                self._base = pinned_bytes(self.capacity_bytes)
                self.held_bytes = 1 << (self.capacity_bytes - 1).bit_length()
            else:
                # An arena dropped without close() (its engine dropped) must not leave its pages
                # registered: once the mmap is gone the kernel may hand the same addresses to the
                # next arena, and CUDA refuses to register them again (error 712).
                unregister = weakref.finalize(self, _cuda_host_unregister, self._base.data_ptr())
                unregister.atexit = False  # at exit the process's mappings go with CUDA's
                self._unregister = unregister
            self._pinned = True
        _live_arenas.add(self)

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A fresh tensor of exactly ``numel`` elements (zero-filled: mmap pages start zeroed)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        start = self.used_bytes
        end = start + nbytes
        if end > self.capacity_bytes:
            raise MemoryError(f"host arena full: {nbytes:,} more bytes requested, {self.capacity_bytes - start:,} free")
        self.used_bytes = _round_up(end, self.alignment)
        return self._base[start:end].view(dtype)

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` was carved from this region (by its storage: an empty tensor
        allocated last points just past the region's end)."""
        return tensor.untyped_storage().data_ptr() == self._base.untyped_storage().data_ptr()

    def give_back(self, tensor: torch.Tensor) -> None:
        """Hand the whole pages under ``tensor`` (carved from this region) back to the kernel: it
        reads zeros afterwards. For state that has moved elsewhere (a plan switch), so the old
        region shrinks while the new one fills. A page-locked region is unlocked first (the
        kernel cannot drop locked pages), for good: nothing copies from it asynchronously again."""
        if self._map is None:
            return  # torch's pinned block: it cannot be returned a page at a time
        self.unpin()
        start = tensor.data_ptr() - self._base.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        first, last = _round_up(start, PAGE_BYTES), end - end % PAGE_BYTES
        if last > first:
            # The region is a shared anonymous mapping (shmem): DONTNEED would unmap the pages
            # and keep their memory; REMOVE frees it.
            self._map.madvise(getattr(mmap, "MADV_REMOVE", mmap.MADV_DONTNEED), first, last - first)

    def unpin(self) -> None:
        """Unlock a region registered with CUDA (for good; the memory stays mapped and readable):
        when nothing will copy from it asynchronously again (its engine closed). Page-locked
        memory is scarce and the kernel cannot reclaim it."""
        if self._unregister is not None:
            self._unregister()  # a finalize runs once
            self._unregister = None
            self._pinned = False

    def close(self) -> None:
        """Release the region (once; again does nothing). Tensors from it must no longer be used."""
        if self not in _live_arenas:
            return
        _live_arenas.discard(self)
        if self._map is None:  # torch's pinned block: back to its allocator, then to the OS
            del self._base
            _empty_host_cache()
            return
        self.unpin()
        del self._base
        self._map.close()


_live_arenas: weakref.WeakSet[MmapArena] = weakref.WeakSet()
"""Every region not yet closed, for ``host_arena_bytes``."""


def host_arena_bytes() -> tuple[int, int]:
    """(held, pinned): the bytes of every ``MmapArena`` of the process not yet closed (the host
    tier's chunk state, the swapped activations' pool, any other engine's), and of those the
    page-locked ones. Whole regions: an arena is mapped, and on CUDA pinned, at its full size."""
    arenas = list(_live_arenas)
    return sum(a.held_bytes for a in arenas), sum(a.held_bytes for a in arenas if a._pinned)


def _cuda_host_register(region: torch.Tensor) -> int:
    """Page-lock ``region`` in place; CUDA's error code (0: done)."""
    return int(torch.cuda.cudart().cudaHostRegister(region.data_ptr(), region.numel(), 0))


def _cuda_host_unregister(address: int) -> None:
    if int(torch.cuda.cudart().cudaHostUnregister(address)):
        _clear_cuda_error()  # not to be raised by the next kernel launch


def _clear_cuda_error() -> None:
    """Read off the thread's last CUDA error. A refused ``cudaHostRegister`` leaves it set, and
    torch's next kernel-launch check would raise it as that kernel's failure (torch binds no
    ``cudaGetLastError``: call it in the CUDA runtime library torch loaded)."""
    library = _cuda_runtime()
    if library is not None:
        library.cudaGetLastError()


@functools.cache
def _cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded (by its path in /proc/self/maps), if any."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def pinned_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory from torch's host allocator."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _empty_host_cache() -> None:
    empty = getattr(torch._C, "_host_emptyCache", None)  # torch's pinned-block cache, where it has one
    if empty is not None:
        empty()


_register_refusals: set[int] = set()


def _warn_register_refused(error: int) -> None:
    """Say once per error code that host regions fall back to torch's pinned allocator."""
    if error in _register_refusals:
        return
    _register_refusals.add(error)
    warnings.warn(
        f"cudaHostRegister refused to page-lock a host region (CUDA error {error}); ProTrain takes "
        "page-locked memory from torch's host allocator instead, which rounds each region up to a "
        "power of two",
        RuntimeWarning,
        stacklevel=3,
    )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
