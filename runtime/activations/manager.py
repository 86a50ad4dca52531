"""Block-wise activation management: the engine's one saved-tensor dispatcher.

Each transformer block has a mode from the plan:

- ``keep``: what autograd saves stays where it is;
- ``checkpoint``: the block is recomputed in backward (``checkpointing``);
- ``swap``: saved tensors are copied to host memory on a side stream (a worker thread on CPU)
  in forward and copied back ahead of need in backward (``transfers``);
- ``ssd``: saved tensors are written to files by an asynchronous I/O pool in forward and read
  back ahead of need in backward (SSDTrain; ``transfers`` over ``ssd_store``).

Every tensor autograd saves passes through ``_pack``: a view of a chunk buffer slot becomes a
recipe (the chunk manager re-gathers it on use); model state (chunk memory, module buffers),
small tensors and anything saved outside an offloaded block are kept as they are; the rest
becomes a ``SavedActivation`` of a deduplicated ``StoredStorage`` (see ``records``).

Forwarding: backward is served from memory without a transfer whenever the bytes are still
there: a copy or write still in flight (its file is then dropped unwritten or deleted), or the
original tensor still held by someone else. Prefetch: backward starts by fetching the last
offloaded blocks, and each block's first unpack fetches the offloaded blocks before it, so at
most ``prefetch_blocks`` blocks are on their way back at a time. In-place changes to a saved
tensor after it was saved raise, as autograd itself would.

An ``SsdIoError`` (a full disk, a failed read) ends the step and first drops the step's
activation files, so the disk has its space back when the caller sees it (``io_failure``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Sequence
from enum import Enum
from typing import Any

import torch
from torch import nn

from protrain.profiler.activation_cost import PREFETCH_BLOCKS
from protrain.profiler.plan import BlockMode
from protrain.runtime.activations.checkpointing import BlockCheckpointing
from protrain.runtime.activations.io_failure import drop_unread_files, drops_files_on_io_error
from protrain.runtime.activations.records import (
    ActivationStats,
    KeptTensor,
    SavedActivation,
    SavedTensorModifiedError,
    StoredStorage,
)
from protrain.runtime.activations.ssd_store import ActivationFileStore, SsdIoError
from protrain.runtime.activations.transfers import ActivationTransfers
from protrain.runtime.chunks.manager import ChunkManager, SavedAlias
from protrain.runtime.hw.device import DeviceInfo

__all__ = ["OFFLOADED", "SMALL_TENSOR_BYTES", "ActivationManager", "ActivationStats", "Phase"]

SMALL_TENSOR_BYTES = 4096
"""Saved storages smaller than this stay put: moving them costs more than the memory saved."""

OFFLOADED = (BlockMode.SWAP, BlockMode.SSD)


class Phase(str, Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class ActivationManager:
    """Carries out the plan's per-block activation modes; see the module docstring.

    The dispatcher keeps the step's records: by storage address (deduplication: a storage saved
    again while alive is not sent twice), by block (prefetch order, and what an I/O error drops),
    and those whose copy or write is still outbound (their originals are held until it lands).
    One lock guards them: on CUDA autograd runs backward (unpack, release) on its own thread.
    """

    def __init__(
        self,
        *,
        blocks: Sequence[nn.Module],
        modes: Sequence[BlockMode],
        chunks: ChunkManager,
        device: DeviceInfo,
        store: ActivationFileStore | None = None,
        model_buffers: Iterable[torch.Tensor] = (),
        prefetch_blocks: int = PREFETCH_BLOCKS,  # the cost model assumes this depth
        min_offload_bytes: int = SMALL_TENSOR_BYTES,
        expected_ssd_bytes: int = 0,
    ) -> None:
        """``store``: an ``ActivationFileStore`` when any block is ``ssd``."""
        if len(blocks) != len(modes):
            raise ValueError(f"{len(modes)} block modes for {len(blocks)} blocks")
        if BlockMode.SSD in modes and store is None:
            raise ValueError("ssd blocks need an activation file store (memory.ssd.path)")
        self.blocks = list(blocks)
        self.modes = list(modes)
        self.chunks = chunks
        self.device = device
        self.store = store
        self.prefetch_blocks = max(1, prefetch_blocks)
        self.min_offload_bytes = min_offload_bytes
        self.stats = ActivationStats()
        self._wait_taken_s = 0.0
        self.phase = Phase.IDLE
        self._block: int | None = None
        self._offloaded_blocks = [i for i, mode in enumerate(self.modes) if mode in OFFLOADED]
        self._buffer_storages = {b.untyped_storage().data_ptr() for b in model_buffers}
        self._model_state: set[int] = set()
        self._by_storage: dict[int, StoredStorage] = {}
        self._by_block: dict[int, list[StoredStorage]] = {}
        self._outbound: list[StoredStorage] = []
        self._saved_in_block: list[tuple[StoredStorage, torch.Tensor, int]] = []
        self._lock = threading.RLock()
        self._transfers = ActivationTransfers(
            device=device,
            store=store,
            stats=self.stats,
            offloads=bool(self._offloaded_blocks),
            expected_ssd_bytes=expected_ssd_bytes,
        )
        self._checkpointing = BlockCheckpointing(chunks=chunks, in_forward=lambda: self.phase is Phase.FORWARD)
        self._handles: list[Any] = []
        self._install()

    # ------------------------------------------------------------------ installation

    def _install(self) -> None:
        for index, (block, mode) in enumerate(zip(self.blocks, self.modes, strict=True)):
            if mode in OFFLOADED:
                self._handles.append(block.register_forward_pre_hook(self._enter_block(index)))
                self._handles.append(block.register_forward_hook(self._leave_block(index)))
            elif mode is BlockMode.CHECKPOINT:
                self._checkpointing.patch(block, index)

    def _enter_block(self, index: int) -> Any:
        def hook(_module: nn.Module, _inputs: Any) -> None:
            if self.phase is Phase.FORWARD:
                self._block = index

        return hook

    def _leave_block(self, index: int) -> Any:
        def hook(_module: nn.Module, _inputs: Any, _output: Any) -> None:
            if self._block == index:
                self._block = None
            self._end_block(index if self.phase is Phase.FORWARD else None)

        return hook

    @drops_files_on_io_error
    def _end_block(self, ended: int | None = None) -> None:
        """The block's forward is over: check that nothing it saved was changed in place since
        (those tensors were held until now, so a change right after saving cannot slip by as
        the tensor dies), then watch them only weakly and let go of what has arrived. After
        offloaded block ``ended``, wait for the blocks before it to have left the device: at most
        two blocks' bytes are then in flight (this one's, and the next one's while it runs),
        whatever the copy engine's or the disk's pace, which is what the plan counts."""
        with self._lock:
            saved, self._saved_in_block = self._saved_in_block, []
            for record, tensor, version in saved:
                record.check_version(tensor, version)
                record.watch(tensor, version)
            del saved
            if ended is not None:
                for record in self._outbound:
                    if record.block < ended:
                        self._transfers.let_go_of_source(record)
            self._reap()

    def suspended(self) -> contextlib.AbstractContextManager[None]:
        """Every block runs as ``keep`` for a while (profiling: a checkpointed block would hide
        what it saves from the profiler; the offloaded blocks' hooks act only in the engine's
        forward anyway)."""
        return self._checkpointing.suspended()

    # ------------------------------------------------------------------ phases

    def saved_tensor_hooks(self) -> contextlib.AbstractContextManager[Any]:
        """The dispatcher for one forward pass (nothing to do when no buffer slot can be reused
        and no block is offloaded)."""
        if not self.chunks.slots and not self._offloaded_blocks:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def begin_forward(self) -> None:
        self.phase = Phase.FORWARD
        self._block = None
        if self._offloaded_blocks:
            self._model_state = self.chunks.model_state_storages() | self._buffer_storages
        self._transfers.begin_forward()

    def end_forward(self) -> None:
        self.phase = Phase.IDLE
        self._block = None
        self._end_block()
        self._transfers.end_forward()

    @drops_files_on_io_error
    def begin_backward(self) -> None:
        """Start fetching the last offloaded blocks: backward needs them first."""
        self.phase = Phase.BACKWARD
        with self._lock:
            self._reap()
            for block in reversed(self._offloaded_blocks):
                if self._by_block.get(block):
                    self._prefetch_before(block + 1)
                    break

    def end_backward(self) -> None:
        self.phase = Phase.IDLE

    # ------------------------------------------------------------------ pack (forward)

    @drops_files_on_io_error
    def _pack(self, tensor: torch.Tensor) -> Any:
        alias = self.chunks.pack_alias(tensor)
        if alias is not None:
            return alias
        block = self._block
        if not isinstance(tensor, torch.Tensor) or type(tensor) is not torch.Tensor:
            return tensor  # parameters and tensor subclasses: autograd's checks apply to them
        if block is None or self.phase is not Phase.FORWARD or not _plain(tensor, self.device.device):
            return KeptTensor(tensor)
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address in self._model_state:
            return tensor.detach()  # not the tensor itself: see KeptTensor
        if storage.nbytes() < self.min_offload_bytes:
            self.stats.kept_small += 1
            return KeptTensor(tensor)
        with self._lock:
            self._reap()
            record = self._by_storage.get(address)
            if record is not None and not record.released and not record.weak.expired():
                self.stats.dedup_hits += 1
            else:
                record = self._transfers.send_away(storage, block, self.modes[block])
                self._by_storage[address] = record
                self._by_block.setdefault(block, []).append(record)
                self._outbound.append(record)
            self._saved_in_block.append((record, tensor, tensor._version))
            return SavedActivation(record, tensor, self._release)

    def _reap(self) -> None:
        """Let go of originals whose bytes have arrived (their memory is freed now), and surface
        a failed write here, in forward, rather than later."""
        with self._lock:
            still: list[StoredStorage] = []
            for record in self._outbound:
                if record.released or self._transfers.arrived(record):
                    continue
                still.append(record)
            self._outbound = still

    # ------------------------------------------------------------------ unpack (backward)

    @drops_files_on_io_error
    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, SavedAlias):
            return self.chunks.unpack_alias(packed)
        if isinstance(packed, KeptTensor):
            return packed.unpack()
        if not isinstance(packed, SavedActivation):
            return packed
        live = packed.live_tensor()
        record = packed.record
        with self._lock:
            if record.modified is None:
                record.check_versions()
            if record.modified is not None:
                raise SavedTensorModifiedError(record.modified)
            self._prefetch_before(record.block + 1)
            if live is not None:
                self.stats.served_live += 1
                return live
            if record.lost is not None:
                raise SsdIoError(record.lost)
            return packed.view_of(self._transfers.bytes_back(record))

    def _prefetch_before(self, block: int) -> None:
        """Start bringing back the ``prefetch_blocks`` offloaded blocks below ``block``."""
        started = 0
        for earlier in range(block - 1, -1, -1):
            records = self._by_block.get(earlier)
            if not records:
                continue
            for record in list(records):  # a release may edit the list meanwhile
                self._transfers.start_inbound(record)
            started += 1
            if started >= self.prefetch_blocks:
                return

    # ------------------------------------------------------------------ release

    def _release(self, record: StoredStorage) -> None:
        """A saved tensor of ``record`` is gone; the last one frees its host memory or file."""
        with self._lock:
            record.live -= 1
            if record.live > 0 or record.released:
                return
            record.released = True
            self._transfers.drop_outbound(record)
            record.restored = None
            record.inbound = None
            if self._by_storage.get(record.address) is record:
                del self._by_storage[record.address]
            block_records = self._by_block.get(record.block)
            if block_records is not None:
                block_records.remove(record)
                if not block_records:
                    del self._by_block[record.block]

    def _drop_files(self, error: SsdIoError) -> None:
        """Drop every ssd activation not yet back in memory and remove its file, so the disk
        has its space back when ``error`` reaches the caller (see ``io_failure``)."""
        if self.store is None:
            return
        with self._lock:
            dropped = drop_unread_files(self._records(), error, self._transfers)
            for record in dropped.records:
                if self._by_storage.get(record.address) is record:
                    del self._by_storage[record.address]  # never a deduplication target again
            self._outbound = [record for record in self._outbound if record.lost is None]
        dropped.settle(self.store)

    def _records(self) -> list[StoredStorage]:
        """Every record of the step, in block order (lock held)."""
        return [record for records in self._by_block.values() for record in records]

    # ------------------------------------------------------------------ the end

    def take_wait_s(self) -> float:
        """Seconds compute waited for activation transfers since the last call."""
        total = self.stats.wait_s
        taken, self._wait_taken_s = total - self._wait_taken_s, total
        return round(taken, 6)

    @property
    def host_bytes(self) -> int:
        """Host bytes that swapped (and, on CUDA, ssd-staged) activations take now."""
        return self._transfers.host_bytes

    @property
    def live_records(self) -> int:
        with self._lock:
            return sum(len(records) for records in self._by_block.values())

    def close(self) -> None:
        """Restore the blocks' forwards, remove hooks, stop the side stream, close the store."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._checkpointing.restore()
        self._transfers.close_stream()
        if self.store is not None:
            # Nothing will read these files any more (a graph never backwarded, a step that
            # failed): the failure of such a write has been reported or no longer matters.
            with self._lock:
                for record in self._records():
                    self._transfers.release_file(record)
            self.store.close()
        with self._lock:
            for record in list(self._outbound):
                record.source = None
            self._outbound.clear()


def _plain(tensor: torch.Tensor, device: torch.device) -> bool:
    """An ordinary dense tensor on the compute device, not a parameter: the kind we can move."""
    return (
        type(tensor) is torch.Tensor
        and tensor.layout is torch.strided
        and tensor.device == device
        and not tensor.is_meta
    )
