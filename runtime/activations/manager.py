"""Block-wise activation management: the engine's one saved-tensor dispatcher.

Each transformer block has a mode from the plan:

- ``keep``: what autograd saves stays where it is;
- ``checkpoint``: the block runs under non-reentrant ``torch.utils.checkpoint`` and is
  recomputed in backward (the chunk manager is told, so recomputation gathers chunks in
  backward order and saves no view of a buffer slot that could be reused under it);
- ``swap``: saved tensors are copied to host memory on a side stream (a worker thread on CPU)
  in forward and copied back ahead of need in backward;
- ``ssd``: saved tensors are written to files by an asynchronous I/O pool in forward and read
  back ahead of need in backward (SSDTrain).

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

An ``SsdIoError`` (a full disk, a failed read) ends the step. Before it reaches the caller, every
ssd activation not yet back in memory is dropped and its file removed, waiting out writes still
running: they belong to the failed pass (or to a graph whose backward would need the same disk),
could never be read again, and a user who catches the error has the disk space back at once.
The store stays open: once space is freed, the next forward writes files again. Backward
through a graph whose activations were dropped raises ``SsdIoError`` saying so.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from profiler.activation_cost import PREFETCH_BLOCKS
from profiler.plan import BlockMode
from runtime.activations.host_pool import HostActivationPool
from runtime.activations.records import KeptTensor, SavedActivation, SavedTensorModifiedError, StoredStorage
from runtime.activations.ssd_store import PendingRead, SsdIoError
from runtime.chunks.manager import ChunkManager, SavedAlias
from runtime.device import DeviceEvent, DeviceInfo, SideStream

SMALL_TENSOR_BYTES = 4096
"""Saved storages smaller than this stay put: moving them costs more than the memory saved."""

OFFLOADED = (BlockMode.SWAP, BlockMode.SSD)

_Result = TypeVar("_Result")


def _drops_files_on_io_error(method: Callable[..., _Result]) -> Callable[..., _Result]:
    """``method`` of ``ActivationManager``: an ``SsdIoError`` it raises first drops the step's
    activation files (see the module docstring), then goes on to the caller."""

    @functools.wraps(method)
    def guarded(self: ActivationManager, *args: Any, **kwargs: Any) -> _Result:
        try:
            return method(self, *args, **kwargs)
        except SsdIoError as err:
            self._drop_files(err)
            raise

    return guarded


class Phase(str, Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(slots=True)
class ActivationStats:
    """Counters since the engine started (tests and benchmarks read them)."""

    records: int = 0
    """Distinct storages sent away (swap or ssd)."""
    dedup_hits: int = 0
    """Saved tensors whose storage was already on its way (no second copy or file)."""
    bytes_swapped_out: int = 0
    bytes_swapped_in: int = 0
    bytes_to_ssd: int = 0
    bytes_from_ssd: int = 0
    forwarded: int = 0
    """Records served from memory in backward, their copy or write still in flight."""
    served_live: int = 0
    """Saved tensors served in backward from the original, still held elsewhere."""
    kept_small: int = 0
    wait_s: float = 0.0
    """Seconds compute waited for activation transfers (exposed I/O): for bytes to come back
    in backward, and for room among the writes in flight in forward."""


class ActivationManager:
    """Carries out the plan's per-block activation modes; see the module docstring."""

    def __init__(
        self,
        *,
        blocks: Sequence[nn.Module],
        modes: Sequence[BlockMode],
        chunks: ChunkManager,
        device: DeviceInfo,
        store: Any = None,
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
        """Guards the records: on CUDA autograd runs backward (unpack, release) on its own thread."""
        self._pool = HostActivationPool(pin=device.is_cuda)
        self._stream = SideStream(device, name="protrain-activations") if self._offloaded_blocks else None
        self._expected_ssd_bytes = expected_ssd_bytes
        self._ssd_bytes_this_forward = 0
        self._handles: list[Any] = []
        self._patched: list[nn.Module] = []
        self._suspended = False
        self._install()

    # ------------------------------------------------------------------ installation

    def _install(self) -> None:
        for index, (block, mode) in enumerate(zip(self.blocks, self.modes, strict=True)):
            if mode in OFFLOADED:
                self._handles.append(block.register_forward_pre_hook(self._enter_block(index)))
                self._handles.append(block.register_forward_hook(self._leave_block(index)))
            elif mode is BlockMode.CHECKPOINT:
                self._patch_checkpoint(block)

    def _enter_block(self, index: int) -> Any:
        def hook(_module: nn.Module, _inputs: Any) -> None:
            if self.phase is Phase.FORWARD:
                self._block = index

        return hook

    def _leave_block(self, index: int) -> Any:
        def hook(_module: nn.Module, _inputs: Any, _output: Any) -> None:
            if self._block == index:
                self._block = None
            self._end_block()

        return hook

    @_drops_files_on_io_error
    def _end_block(self) -> None:
        """The block's forward is over: check that nothing it saved was changed in place since
        (those tensors were held until now, so a change right after saving cannot slip by as
        the tensor dies), then watch them only weakly and let go of what has arrived."""
        with self._lock:
            saved, self._saved_in_block = self._saved_in_block, []
            for record, tensor, version in saved:
                record.check_version(tensor, version)
                record.watch(tensor, version)
            del saved
            self._reap()

    def _patch_checkpoint(self, block: nn.Module) -> None:
        """Run ``block`` under non-reentrant checkpointing: its forward is replaced by one that
        calls the original through ``torch.utils.checkpoint`` (restored by ``close``)."""
        original = block.forward

        def run(*args: Any, **kwargs: Any) -> Any:
            if self.phase is Phase.FORWARD:
                return original(*args, **kwargs)
            # Called again by checkpoint's unpack: this is the recomputation, inside backward.
            with self.chunks.recomputing():
                return original(*args, **kwargs)

        def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
            if self._suspended or not torch.is_grad_enabled():
                return original(*args, **kwargs)
            return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed_forward  # type: ignore[method-assign]
        self._patched.append(block)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Every block runs as ``keep`` for a while (profiling: a checkpointed block would hide
        what it saves from the profiler; the offloaded blocks' hooks act only in the engine's
        forward anyway)."""
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False

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
        if self.store is not None:
            self.store.check_free_space(self._expected_ssd_bytes)
        self._ssd_bytes_this_forward = 0

    def end_forward(self) -> None:
        self.phase = Phase.IDLE
        self._block = None
        self._end_block()
        self._expected_ssd_bytes = max(self._expected_ssd_bytes, self._ssd_bytes_this_forward)

    @_drops_files_on_io_error
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

    @_drops_files_on_io_error
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
            return tensor
        if storage.nbytes() < self.min_offload_bytes:
            self.stats.kept_small += 1
            return KeptTensor(tensor)
        with self._lock:
            self._reap()
            record = self._by_storage.get(address)
            if record is not None and not record.released and not record.weak.expired():
                self.stats.dedup_hits += 1
            else:
                record = self._send_away(storage, block)
            self._saved_in_block.append((record, tensor, tensor._version))
            return SavedActivation(record, tensor, self._release)

    def _send_away(self, storage: torch.UntypedStorage, block: int) -> StoredStorage:
        source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        mode = self.modes[block]
        record = StoredStorage(
            block=block,
            mode=mode,
            nbytes=storage.nbytes(),
            device=source.device,
            address=storage.data_ptr(),
            weak=StorageWeakRef(storage),
            source=source,
        )
        self.stats.records += 1
        if mode is BlockMode.SWAP or self.device.is_cuda:
            # To host memory on the side stream (CUDA ssd: staged there, written once copied).
            record.host = self._pool.allocate(record.nbytes)
            host = record.host
            record.outbound = self._submit(lambda: host.copy_(source, non_blocking=True))
            if mode is BlockMode.SWAP:
                self.stats.bytes_swapped_out += record.nbytes
        else:
            started = time.perf_counter()
            record.file = self.store.write(source)  # blocks while too many bytes are in flight
            self.stats.wait_s += time.perf_counter() - started
            self._count_ssd_write(record)
        self._by_storage[storage.data_ptr()] = record
        self._by_block.setdefault(block, []).append(record)
        self._outbound.append(record)
        return record

    def _count_ssd_write(self, record: StoredStorage) -> None:
        self.stats.bytes_to_ssd += record.nbytes
        self._ssd_bytes_this_forward += record.nbytes

    def _submit(self, work: Any) -> DeviceEvent:
        assert self._stream is not None
        return self._stream.submit(work)

    def _reap(self) -> None:
        """Let go of originals whose bytes have arrived (their memory is freed now), and surface
        a failed write here, in forward, rather than later."""
        with self._lock:
            still: list[StoredStorage] = []
            for record in self._outbound:
                if record.released or self._arrived(record):
                    continue
                still.append(record)
            self._outbound = still

    def _arrived(self, record: StoredStorage) -> bool:
        if record.outbound is not None:
            if not record.outbound.query():
                return False
            record.outbound.wait()  # re-raises a failed copy
            record.outbound = None
            record.check_versions()
            record.source = None
            if record.mode is BlockMode.SSD:
                # CUDA: the bytes are staged in host memory; write them from there.
                assert record.host is not None
                record.file = self.store.write(record.host)
                self._count_ssd_write(record)
        if record.file is not None:
            if not record.file.written():
                return False
            record.file.wait_written()  # raises SsdIoError for a failed write
            self._free_host(record)  # CUDA staging, if any
        record.check_versions()
        record.source = None
        return True

    # ------------------------------------------------------------------ unpack (backward)

    @_drops_files_on_io_error
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
            return packed.view_of(self._bytes_back(record))

    def _prefetch_before(self, block: int) -> None:
        """Start bringing back the ``prefetch_blocks`` offloaded blocks below ``block``."""
        started = 0
        for earlier in range(block - 1, -1, -1):
            records = self._by_block.get(earlier)
            if not records:
                continue
            for record in list(records):  # a release may edit the list meanwhile
                self._start_inbound(record)
            started += 1
            if started >= self.prefetch_blocks:
                return

    def _start_inbound(self, record: StoredStorage) -> None:
        if record.released or record.lost is not None:
            return
        if record.restored is not None or record.inbound is not None:
            return
        if record.source is not None:
            # Forwarding: the original is still in memory (its copy or write in flight). A write
            # that already failed still fails the step: the disk is full or broken.
            if record.file is not None and record.file.written():
                record.file.wait_written()
            record.restored = record.source
            record.source = None
            self.stats.forwarded += 1
            self._drop_outbound(record)
            return
        if record.mode is BlockMode.SWAP or (record.mode is BlockMode.SSD and record.file is None):
            assert record.host is not None
            restored = torch.empty(record.nbytes, dtype=torch.uint8, device=record.device)
            host = record.host
            record.inbound = self._submit(lambda: restored.copy_(host, non_blocking=True))
            record.restored = restored
            self.stats.bytes_swapped_in += record.nbytes
            return
        record.inbound = self.store.read(record.file)
        self.stats.bytes_from_ssd += record.nbytes

    def _bytes_back(self, record: StoredStorage) -> torch.Tensor:
        """The record's bytes on the device, waiting for them if they are still on the way."""
        self._start_inbound(record)
        inbound, record.inbound = record.inbound, None
        started = time.perf_counter()
        if isinstance(inbound, DeviceEvent):
            assert self._stream is not None
            self._stream.make_compute_wait(inbound)
            self.stats.wait_s += time.perf_counter() - started
        elif inbound is not None:
            data = inbound.result()  # raises SsdIoError on any failure: never zeros
            self.stats.wait_s += time.perf_counter() - started
            record.restored = data.to(record.device, non_blocking=True) if self.device.is_cuda else data
            self.store.release(record.file)
            record.file = None
        assert record.restored is not None
        return record.restored

    # ------------------------------------------------------------------ release

    def _release(self, record: StoredStorage) -> None:
        """A saved tensor of ``record`` is gone; the last one frees its host memory or file."""
        with self._lock:
            record.live -= 1
            if record.live > 0 or record.released:
                return
            record.released = True
            self._drop_outbound(record)
            record.restored = None
            record.inbound = None
            if self._by_storage.get(record.address) is record:
                del self._by_storage[record.address]
            block_records = self._by_block.get(record.block)
            if block_records is not None:
                block_records.remove(record)
                if not block_records:
                    del self._by_block[record.block]

    def _drop_outbound(self, record: StoredStorage) -> None:
        """Cancel or wait out the record's copy to host, delete its file, free its host bytes."""
        if record.outbound is not None:
            record.outbound.wait()  # the copy writes into the host buffer: let it land first
            record.outbound = None
        if record.file is not None:
            self.store.release(record.file)
            record.file = None
        self._free_host(record)
        record.source = None

    def _drop_files(self, error: SsdIoError) -> None:
        """Drop every ssd activation not yet back in memory and remove its file (a write still
        running is awaited, a read in flight too: an open file keeps its blocks), so the disk
        has its space back when ``error`` reaches the caller."""
        if self.store is None:
            return
        with self._lock:
            doomed = [
                record
                for records in self._by_block.values()
                for record in records
                if record.mode is BlockMode.SSD and record.restored is None and record.lost is None
            ]
            files = [record.file for record in doomed if record.file is not None]
            reads = [record.inbound for record in doomed if isinstance(record.inbound, PendingRead)]
            for record in doomed:
                self._forget(record, error)
            self._outbound = [record for record in self._outbound if record.lost is None]
        self.store.discard(files)
        for read in reads:
            with contextlib.suppress(SsdIoError):  # its file is gone: it fails, or it had finished
                read.result()

    def _forget(self, record: StoredStorage, error: SsdIoError) -> None:
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
        self._free_host(record)
        record.source = None
        if self._by_storage.get(record.address) is record:
            del self._by_storage[record.address]  # never a deduplication target again

    def _free_host(self, record: StoredStorage) -> None:
        if record.host is not None:
            record.host = None
            self._pool.free()

    # ------------------------------------------------------------------ the end

    @property
    def live_records(self) -> int:
        with self._lock:
            return sum(len(records) for records in self._by_block.values())

    def close(self) -> None:
        """Restore the blocks' forwards, remove hooks, stop the side stream, close the store."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for block in self._patched:
            del block.forward  # the instance attribute; the class's forward shows again
        self._patched.clear()
        if self._stream is not None:
            self._stream.close()
        if self.store is not None:
            # Nothing will read these files any more (a graph never backwarded, a step that
            # failed): the failure of such a write has been reported or no longer matters.
            with self._lock:
                for records in self._by_block.values():
                    for record in records:
                        if record.file is not None:
                            self.store.release(record.file)
                            record.file = None
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
