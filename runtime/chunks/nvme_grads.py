"""The kept gradients of the NVMe tier's chunks, in files beside their state (nvme_state.py).

A window that must keep its gradients (clipping, fp16's overflow check, accumulation) would
otherwise hold an fp32 gradient shard on the host for every NVMe chunk: 4 bytes per parameter,
as much as an fp32 master and twice a 16-bit compute copy, the memory the tier exists to free.
Instead each NVMe chunk's gradient lives in ``chunk{i}.grad`` in the tier's run directory and
passes through one of two page-aligned host buffers (the chunk's position among the NVMe chunks,
mod 2, so the adds of one chunk overlap the write behind of the previous one):

- ``held(i, writes=...)``: the gradient in its buffer for one job on the host worker (an add, a
  norm, an update): read from its file unless the buffer still holds it or it is zero (nothing
  is read for a window's first micro-batch), written back behind the job when it ``writes``;
- ``zero(i)``: the gradient is zero from now on (after its update): nothing is written.

Per window and NVMe chunk that is one write of 4 bytes per parameter per micro-batch, a read per
micro-batch after the first, and a read for the update unless its buffer still holds it (the
update order starts at the chunks backward reached last: the first two updates find theirs).
The norm of a gradient is taken while it is held for its last add (optimizer.py), so the norm
reads nothing. Reads and writes run on the tier's I/O thread, in order with its state I/O.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from protrain.profiler.host_bytes import NVME_GRADIENT_BUFFERS, nvme_tensor_bytes
from protrain.runtime.chunks.nvme_files import NvmeCounters, TierFile, create_file, read_tensors, wait_io, write_tensors
from protrain.runtime.hw.device import DeviceEvent
from protrain.runtime.hw.host_memory import MmapArena


@dataclass(slots=True)
class _Buffer:
    tensor: torch.Tensor
    holder: int | None = None
    """The chunk whose gradient the buffer holds (as its file will once the write behind lands)."""
    last_io: DeviceEvent | None = None


class NvmeGradients:
    """The gradient files and host buffers of one tier's NVMe chunks (see the module docstring)."""

    def __init__(
        self,
        *,
        run_dir: Path,
        chunks: Sequence[tuple[int, int]],
        shard_numel: int,
        direct_io: bool,
        submit: Callable[[Callable[[], None]], DeviceEvent],
        counters: NvmeCounters,
    ) -> None:
        """``chunks``: (chunk index, this rank's real elements) of each NVMe chunk in chunk order;
        ``submit`` queues a job on the tier's I/O thread; ``counters`` are the tier's."""
        self.direct_io = direct_io
        self._submit = submit
        self.counters = counters
        self._lock = threading.Lock()
        self._files: dict[int, TierFile] = {}
        self._zero: set[int] = set()
        """Chunks whose gradient is zero: nothing to read (every one until its first add)."""
        count = min(NVME_GRADIENT_BUFFERS, len(chunks))
        length = nvme_tensor_bytes(shard_numel)
        self._arena = MmapArena(count * length)
        self._buffers = [_Buffer(self._arena.allocate(length // 4, torch.float32)) for _ in range(count)]
        try:
            for position, (index, numel) in enumerate(chunks):
                self._files[index] = create_file(
                    run_dir / f"chunk{index:05d}.grad",
                    nvme_tensor_bytes(numel),
                    what="gradient file",
                    numel=numel,
                    slot=position % max(1, count),
                    direct_io=direct_io,
                )
                self._zero.add(index)
        except BaseException:
            self.close()
            raise

    def holds(self, index: int) -> bool:
        return index in self._files

    @property
    def file_bytes(self) -> int:
        return sum(nvme_tensor_bytes(f.numel) for f in self._files.values())

    @property
    def buffer_bytes(self) -> int:
        return self._arena.capacity_bytes

    def contains(self, tensor: torch.Tensor) -> bool:
        return self._arena.contains(tensor)

    @contextlib.contextmanager
    def held(self, index: int, *, writes: bool) -> Iterator[torch.Tensor]:
        """Chunk ``index``'s gradient in its host buffer for the block; written back behind it
        when the block ``writes`` it (a block that changes it without ``writes`` must ``zero``
        it after)."""
        grad_file = self._files[index]
        buffer = self._buffers[grad_file.slot]
        grad = buffer.tensor[: grad_file.numel]
        fill_zero = False
        with self._lock:
            if buffer.holder != index:
                if index in self._zero:
                    fill_zero = True  # after the buffer's last write has read it
                else:
                    buffer.last_io = self._submit(lambda: self._read(grad_file, buffer.tensor))
                    self.counters.reads += 1
                    self.counters.bytes_read += nvme_tensor_bytes(grad_file.numel)
                buffer.holder = index
                must_wait = True
            else:  # the buffer has it; only a change must wait for the write behind to read it
                must_wait = writes
            pending = buffer.last_io if must_wait else None
        try:
            if pending is not None:
                wait_io(pending)
            if fill_zero:
                grad.zero_()
            yield grad
        except BaseException:
            with self._lock:
                buffer.holder = None  # what the buffer holds is no longer known to be the file's
            raise
        if writes:
            with self._lock:
                self._zero.discard(index)
                buffer.last_io = self._submit(lambda: self._write(grad_file, buffer.tensor))
                self.counters.writes += 1
                self.counters.bytes_written += nvme_tensor_bytes(grad_file.numel)

    def zero(self, index: int) -> None:
        """Chunk ``index``'s gradient is zero from now on (its file is not written)."""
        with self._lock:
            self._zero.add(index)
            buffer = self._buffers[self._files[index].slot]
            if buffer.holder == index:
                buffer.holder = None

    def pending_io(self) -> list[DeviceEvent]:
        with self._lock:
            return [buffer.last_io for buffer in self._buffers if buffer.last_io is not None]

    def _read(self, grad_file: TierFile, tensor: torch.Tensor) -> None:
        read_tensors(grad_file, (tensor,), nvme_tensor_bytes(grad_file.numel), direct_io=self.direct_io)

    def _write(self, grad_file: TierFile, tensor: torch.Tensor) -> None:
        write_tensors(grad_file, (tensor,), nvme_tensor_bytes(grad_file.numel), direct_io=self.direct_io)

    def close(self) -> None:
        """Close the files (the tier removes its run directory) and unmap the buffers; the I/O
        thread is stopped first (the tier's ``close``)."""
        for grad_file in self._files.values():
            with contextlib.suppress(OSError):
                os.close(grad_file.fd)
        self._files.clear()
        self._buffers = []
        self._arena.close()
