"""Host memory regions: exact-size host tensors carved from anonymous mmaps (the host tier's
chunk state, swapped activations, staging), page-locked on CUDA, and what the process holds in
them. Part of the device layer (runtime/device.py), kept apart for size.

On CPU the regions are invisible to glibc's ``mallinfo2``, which then counts only what the device
tier allocates: tests measure the device tier independently of our bookkeeping.
"""

from __future__ import annotations

import mmap
import weakref

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
        self.alignment = alignment
        self._map = mmap.mmap(-1, self.capacity_bytes)
        self._base = torch.frombuffer(self._map, dtype=torch.uint8)
        self.used_bytes = 0
        self._pinned = False
        if pin:
            _cuda_host_register(self._base)
            self._pinned = True
        _live_arenas.add(self)

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A fresh tensor of exactly ``numel`` elements (zero-filled: mmap pages start zeroed)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        start = self.used_bytes
        end = start + nbytes
        if end > self.capacity_bytes:
            raise MemoryError(
                f"host arena full: {nbytes:,} more bytes requested, {self.capacity_bytes - start:,} free"
            )
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
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._base.data_ptr())
            self._pinned = False
        start = tensor.data_ptr() - self._base.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        first, last = _round_up(start, PAGE_BYTES), end - end % PAGE_BYTES
        if last > first:
            # The region is a shared anonymous mapping (shmem): DONTNEED would unmap the pages
            # and keep their memory; REMOVE frees it.
            self._map.madvise(getattr(mmap, "MADV_REMOVE", mmap.MADV_DONTNEED), first, last - first)

    def close(self) -> None:
        """Release the region (once; again does nothing). Tensors from it must no longer be used."""
        if self._map.closed:
            return
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._base.data_ptr())
            self._pinned = False
        del self._base
        self._map.close()
        _live_arenas.discard(self)


_live_arenas: weakref.WeakSet[MmapArena] = weakref.WeakSet()
"""Every region not yet closed, for ``host_arena_bytes``."""


def host_arena_bytes() -> tuple[int, int]:
    """(held, pinned): the bytes of every ``MmapArena`` of the process not yet closed (the host
    tier's chunk state, the swapped activations' pool, any other engine's), and of those the
    page-locked ones. Whole regions: an arena is mapped, and on CUDA pinned, at its full size."""
    arenas = list(_live_arenas)
    return sum(a.capacity_bytes for a in arenas), sum(a.capacity_bytes for a in arenas if a._pinned)


def _cuda_host_register(region: torch.Tensor) -> None:
    result = torch.cuda.cudart().cudaHostRegister(region.data_ptr(), region.numel(), 0)
    if int(result) != 0:
        raise RuntimeError(f"cudaHostRegister failed with error {int(result)}")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
