"""The NVMe tier of chunk state (``memory.ssd.n_optimizer``): the optimizer rule's state tensors
of the last offloaded chunks live in files under ``memory.ssd.path`` instead of host memory.

Per chunk one file in this rank's run directory (``protrain-optim-{host}-{pid}-rank{rank}``,
removed when the tier closes, after a crash by the next run on that path), each state tensor at
a 4 KiB-aligned offset, preallocated when the tier opens so that a full disk is refused before
training, not in the middle of an update. In fp32 the master stays in host memory: it is what
forward uploads, so reading it back for every forward would double the tier's traffic. In a
16-bit compute dtype the fp32 master is the file's first tensor and the host keeps the compute
copy forward uploads, refreshed by each update (``copy_out``) and after anything writes the
file's master (a checkpoint load, a plan switch). Kept gradients (clipping, fp16, accumulation)
go to files of their own beside the state (nvme_grads.py): the host holds no gradient shard of
an NVMe chunk.

The host keeps ``min(3, n)`` slots of a shard's file tensors (page-aligned, from their own
mmap): the update of chunk ``i`` runs on slot ``i mod slots``, so each chunk's kernel
(runtime/optim/) is built once over its slot's tensors and never rebound. One I/O thread moves
bytes between slots and files with O_DIRECT where the filesystem allows it (buffered I/O that
drops the page cache behind itself elsewhere), straight from and into the slot's memory:

- ``resident(i)`` (around an update): wait for chunk ``i``'s state in its slot (read now unless
  read ahead), then queue its write behind;
- ``prefetch(i)``: queue the read of the next chunk the update order will reach, while the
  current one updates (jobs run in order, so a read into a slot follows the slot's last write).

A slot keeps what it holds until another chunk needs it, so a chunk updated twice in a row
(early, then at the step) is read once. Checkpoints and re-plans reach the files through
``mapped(i)``: views of the file itself (``torch.from_file``), read and written page by page as
they are used, never the whole tier in memory at once; the I/O thread is drained first and the
chunk's slot forgotten, since a load may write the file behind it.

Failures (a read that comes back short, an I/O error) raise ``SsdIoError`` naming the path, on
the thread that waits for the bytes; the tier is then unusable (its state is no longer known to
be on disk), as a failed CUDA stream is.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from protrain.profiler.host_bytes import NVME_SLOTS, nvme_file_bytes, nvme_tensor_bytes
from protrain.runtime.chunks.nvme_files import NvmeCounters, TierFile, create_file, read_tensors, wait_io, write_tensors
from protrain.runtime.chunks.nvme_grads import NvmeGradients
from protrain.runtime.hw import run_dirs
from protrain.runtime.hw.device import DeviceEvent, HostWorker
from protrain.runtime.hw.host_memory import MmapArena
from protrain.runtime.hw.ssd_io import BLOCK_BYTES, SsdIoError, StagingBuffers, check_free_space, choose_direct_io

RUN_DIR_PREFIX = "protrain-optim-"


@dataclass(slots=True)
class _Slot:
    """Host memory one NVMe chunk's state is updated in: a tensor per state, page-aligned."""

    states: tuple[torch.Tensor, ...]
    occupant: int | None = None
    """The chunk whose state the slot holds (read, or queued to be read), if any."""
    busy: bool = False
    """An update is using the slot: nothing may be read into it."""
    last_io: DeviceEvent | None = None
    """The slot's latest read or write on the I/O thread."""


class NvmeStateTier:
    """The files and slots of one chunk store's NVMe chunks (see the module docstring)."""

    def __init__(
        self,
        *,
        root: Path,
        rank: int,
        chunks: Sequence[tuple[int, int]],
        tensors: int,
        shard_numel: int,
        gradients: bool = False,
        direct_io: bool | None = None,
    ) -> None:
        """``chunks``: (chunk index, this rank's real elements) of each NVMe chunk, in chunk
        order; ``tensors``: fp32 tensors each keeps in its file (profiler/host_bytes.py's
        ``nvme_tensors``: the rule's state, and the master in a 16-bit compute dtype, first);
        ``gradients``: the chunks keep their gradients (in files too: nvme_grads.py)."""
        if tensors <= 0:
            raise ValueError("the optimizer keeps no state per parameter: nothing to keep on NVMe")
        self.tensors = tensors
        self._mapped: dict[int, weakref.ref[torch.Tensor]] = {}
        """Storage address -> the file mapping ``mapped`` made there (``holds_tensor``)."""
        self.counters = NvmeCounters()
        self._lock = threading.Lock()
        self._closed = False
        self.run_dir = run_dirs.create_run_dir(root, rank, prefix=RUN_DIR_PREFIX, what="optimizer state files")
        # Dropped without close, or the interpreter exits (Ctrl-C): the files go all the same.
        self._remove_dir = weakref.finalize(self, _remove_quietly, self.run_dir)
        self._files: dict[int, TierFile] = {}
        self._slots: list[_Slot] = []
        self._arena: MmapArena | None = None
        self._worker: HostWorker | None = None
        self.gradients: NvmeGradients | None = None
        """The chunks' kept gradients (clipping, fp16, accumulation), if they keep them."""
        try:
            needed = sum(nvme_file_bytes(numel, tensors + (1 if gradients else 0)) for _, numel in chunks)
            check_free_space(self.run_dir, needed, what="optimizer state files", knob="memory.ssd.n_optimizer")
            self.direct_io = choose_direct_io(direct_io, self.run_dir, StagingBuffers(1, BLOCK_BYTES))
            count = min(NVME_SLOTS, len(chunks))
            tensor_bytes = nvme_tensor_bytes(shard_numel)
            arena = self._arena = MmapArena(count * tensors * tensor_bytes)
            self._slots = [
                _Slot(states=tuple(arena.allocate(tensor_bytes // 4, torch.float32) for _ in range(tensors)))
                for _ in range(count)
            ]
            for position, (index, numel) in enumerate(chunks):
                self._files[index] = self._create(index, numel, slot=position % max(1, count))
            self._worker = HostWorker("protrain-nvme-io", kind="the NVMe I/O thread")
            if gradients:
                self.gradients = NvmeGradients(
                    run_dir=self.run_dir,
                    chunks=chunks,
                    shard_numel=shard_numel,
                    direct_io=self.direct_io,
                    submit=self._submit,
                    counters=self.counters,
                )
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ setup

    def check_room(self, beside: int, words: str) -> None:
        """Refuse (``SsdIoError``) when the disk, holding the files now, has not ``beside`` bytes
        more free for what else goes there (``words`` says what); the files are removed."""
        if beside <= 0:
            return
        try:
            what = f"{words} beside the optimizer state files"
            check_free_space(self.run_dir, beside, what=what, knob="memory.ssd.n_optimizer")
        except SsdIoError:
            self.close()
            raise

    def _create(self, index: int, numel: int, *, slot: int) -> TierFile:
        return create_file(
            self.run_dir / f"chunk{index:05d}.state",
            nvme_file_bytes(numel, self.tensors),
            what="optimizer state file",
            numel=numel,
            slot=slot,
            direct_io=self.direct_io,
        )

    # ------------------------------------------------------------------ what the update sees

    def holds(self, index: int) -> bool:
        """Whether chunk ``index``'s optimizer state is on NVMe."""
        return index in self._files

    @property
    def chunk_indices(self) -> list[int]:
        return sorted(self._files)

    def following(self, index: int, *, descending: bool) -> int | None:
        """The NVMe chunk an update order reaches after ``index`` (backward updates go down the
        chunks, the step's go up), if any."""
        indices = self.chunk_indices
        position = indices.index(index) + (-1 if descending else 1)
        return indices[position] if 0 <= position < len(indices) else None

    def read_ahead(self, *, descending: bool) -> None:
        """Queue the read of the first NVMe chunk an update order reaches (backward's: the last)."""
        indices = self.chunk_indices
        if indices:
            self.prefetch(indices[-1] if descending else indices[0])

    @contextlib.contextmanager
    def updating(self, index: int, *, descending: bool) -> Iterator[None]:
        """Around an update of chunk ``index`` (any chunk: one not on NVMe passes through): its
        state resident in its slot, the next NVMe chunk of the update order read meanwhile."""
        if index not in self._files:
            yield
            return
        with self.resident(index):
            following = self.following(index, descending=descending)
            if following is not None:
                self.prefetch(following)
            yield

    def slot_states(self, index: int) -> tuple[torch.Tensor, ...]:
        """The tensors chunk ``index``'s kernel is built over: its slot's, cut to its elements.
        They hold the chunk's state only inside ``resident(index)``."""
        state_file = self._files[index]
        return tuple(tensor[: state_file.numel] for tensor in self._slots[state_file.slot].states)

    def prefetch(self, index: int) -> None:
        """Queue the read of chunk ``index``'s state into its slot, unless the slot holds it
        already or an update is using the slot (the update then reads it when it comes)."""
        if index not in self._files:
            return
        with self._lock:
            slot = self._slots[self._files[index].slot]
            if slot.busy or slot.occupant == index:
                return
            self._queue_read(index, slot)

    @contextlib.contextmanager
    def resident(self, index: int) -> Iterator[None]:
        """Chunk ``index``'s state in its slot for the block (its kernel's tensors), written
        back behind it. One update at a time per slot (the host worker's order guarantees it)."""
        state_file = self._files[index]
        with self._lock:
            slot = self._slots[state_file.slot]
            if slot.busy:
                raise RuntimeError(f"NVMe slot {state_file.slot} is in use by chunk {slot.occupant}")
            if slot.occupant != index:
                self._queue_read(index, slot)
            slot.busy = True
            loaded = slot.last_io
        try:
            if loaded is not None:
                wait_io(loaded)
            yield
        except BaseException:
            with self._lock:
                slot.busy = False
                slot.occupant = None  # what the slot holds is no longer known to be the file's
            raise
        with self._lock:
            slot.busy = False
            slot.last_io = self._submit(lambda: self._write(state_file, slot.states))
            self.counters.writes += 1
            self.counters.bytes_written += nvme_file_bytes(state_file.numel, self.tensors)

    def _queue_read(self, index: int, slot: _Slot) -> None:
        """(lock held) Read ``index`` into ``slot`` after the slot's last I/O (jobs run in order)."""
        state_file = self._files[index]
        slot.occupant = index
        slot.last_io = self._submit(lambda: self._read(state_file, slot.states))
        self.counters.reads += 1
        self.counters.bytes_read += nvme_file_bytes(state_file.numel, self.tensors)

    def _submit(self, job: Callable[[], None]) -> DeviceEvent:
        if self._worker is None or self._closed:
            raise RuntimeError("the NVMe state tier is closed")
        return self._worker.submit(job)

    def drain(self) -> None:
        """Wait for every read and write queued; raise the first failure."""
        with self._lock:
            pending = [slot.last_io for slot in self._slots if slot.last_io is not None]
        if self.gradients is not None:
            pending += self.gradients.pending_io()
        for event in pending:
            wait_io(event)

    # ------------------------------------------------------------------ checkpoints, re-plans

    def mapped(self, index: int) -> tuple[torch.Tensor, ...]:
        """Chunk ``index``'s state tensors as views of its file (``torch.from_file``, shared):
        what a checkpoint saves from and loads into, page by page. The I/O thread is drained
        first and the slot forgotten (a load writes the file behind its back)."""
        self.drain()
        state_file = self._files[index]
        with self._lock:
            slot = self._slots[state_file.slot]
            if slot.occupant == index:
                slot.occupant = None
        tensor_numel = nvme_tensor_bytes(state_file.numel) // 4
        if tensor_numel == 0:
            return tuple(torch.empty(0) for _ in range(self.tensors))
        size = tensor_numel * self.tensors
        whole = torch.from_file(str(state_file.path), shared=True, size=size, dtype=torch.float32)
        # Mappings go with their last view (each save makes new ones): forget those gone.
        self._mapped = {pointer: ref for pointer, ref in self._mapped.items() if ref() is not None}
        self._mapped[whole.untyped_storage().data_ptr()] = weakref.ref(whole)
        return tuple(whole[k * tensor_numel : k * tensor_numel + state_file.numel] for k in range(self.tensors))

    @property
    def file_bytes(self) -> int:
        """Bytes the tier's files take on disk."""
        states = sum(nvme_file_bytes(f.numel, self.tensors) for f in self._files.values())
        return states + (0 if self.gradients is None else self.gradients.file_bytes)

    @property
    def slot_bytes(self) -> int:
        """Host memory the tier maps: its state slots and gradient buffers."""
        slots = 0 if self._arena is None else self._arena.capacity_bytes
        return slots + (0 if self.gradients is None else self.gradients.buffer_bytes)

    def holds_tensor(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is slot memory or a view of a file ``mapped`` made (host memory,
        not the device's)."""
        if self._arena is not None and self._arena.contains(tensor):
            return True
        if self.gradients is not None and self.gradients.contains(tensor):
            return True
        pointer = tensor.untyped_storage().data_ptr()
        mapping = self._mapped.get(pointer)
        alive = mapping is not None and mapping() is not None
        if mapping is not None and not alive:
            del self._mapped[pointer]
        return alive

    # ------------------------------------------------------------------ the I/O thread

    def _read(self, state_file: TierFile, states: tuple[torch.Tensor, ...]) -> None:
        read_tensors(state_file, states, nvme_tensor_bytes(state_file.numel), direct_io=self.direct_io)

    def _write(self, state_file: TierFile, states: tuple[torch.Tensor, ...]) -> None:
        write_tensors(state_file, states, nvme_tensor_bytes(state_file.numel), direct_io=self.direct_io)

    # ------------------------------------------------------------------ closing

    def stop(self) -> None:
        """Run the queued reads and writes and stop the I/O thread (its engine closed); the files
        stay readable through ``mapped`` until ``close`` (a plan switch moves them)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def close(self) -> None:
        """Stop the I/O thread, close and remove the files (once; again does nothing). Views
        from ``mapped`` stay readable (the kernel keeps an unlinked file's pages while mapped)."""
        if self._closed:
            return
        self._closed = True
        self.stop()
        for state_file in self._files.values():
            with contextlib.suppress(OSError):
                os.close(state_file.fd)
        self._files.clear()
        if self.gradients is not None:
            self.gradients.close()
        self._remove_dir()
        if self._arena is not None:
            self._slots = []
            self._arena.close()


def _remove_quietly(run_dir: Path) -> None:
    with contextlib.suppress(SsdIoError):
        run_dirs.remove_run_dir(run_dir)
