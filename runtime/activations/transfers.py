"""The offload modes' mechanics: one saved storage's bytes away in forward, back in backward.

``ActivationManager`` decides what leaves the device (deduplicated storages saved by ``swap`` and
``ssd`` blocks) and in which order it comes back (prefetch); ``ActivationTransfers`` moves the
bytes of one ``StoredStorage`` by its block's mode:

- ``swap``: copied into host memory (``HostActivationPool``) on the side stream (a worker thread
  on CPU) in forward, copied back on it in backward;
- ``ssd``: written to a file by the ``ActivationFileStore`` in forward and read back in backward
  (SSDTrain). On CUDA the bytes are first staged in host memory on the side stream and written
  from there once the copy has landed;
- forwarding: while a copy or write is still in flight the original is held (``source``), and a
  backward that needs it then is served from memory: the copy or file is dropped unused.

Every method runs under the manager's lock (on CUDA autograd runs backward on its own thread).

Both copies run on the side stream on memory the compute stream allocated (the original storage
read by a swap-out, the buffer a swap-in fills): on CUDA each job marks them used on the side
stream (``record_stream``), so the caching allocator cannot hand their memory to new compute
work while the copy still runs, whenever the compute side lets go of them. (Swap-out also keeps
``source`` until its copy's event has fired, but that alone does not cover ``close`` or a
released record whose swap-in was prefetched and never used.) Under stream chaos a swap-in's
device buffer is NaN until its copy lands, a freed host buffer is checked and poisoned
(host_pool.py), and a failure seen on autograd's release path, where exceptions are swallowed,
is raised again by the next forward.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from protrain.profiler.plan import BlockMode
from protrain.runtime.activations.host_pool import HostActivationPool
from protrain.runtime.activations.records import ActivationStats, StoredStorage
from protrain.runtime.activations.ssd_store import ActivationFileStore
from protrain.runtime.chunks.trace_labels import job_label
from protrain.runtime.hw import stream_chaos
from protrain.runtime.hw.device import DeviceEvent, DeviceInfo, SideStream, used_on_this_stream


class ActivationTransfers:
    """Swap copies and ssd files of ``StoredStorage`` records, with the counters they feed.

    ``offloads``: whether any block is ``swap`` or ``ssd`` (only then is there a side stream).
    ``expected_ssd_bytes``: the bytes one forward writes to files, checked free on the disk before
    each forward; it grows to the most a forward has written.
    """

    def __init__(
        self,
        *,
        device: DeviceInfo,
        store: ActivationFileStore | None,
        stats: ActivationStats,
        offloads: bool,
        expected_ssd_bytes: int,
    ) -> None:
        self.device = device
        self.store = store
        self.stats = stats
        self._pool = HostActivationPool(pin=device.is_cuda)
        self._stream = SideStream(device, name="protrain-activations") if offloads else None
        self._expected_ssd_bytes = expected_ssd_bytes
        self._ssd_bytes_this_forward = 0
        self._chaos = stream_chaos.enabled()
        self._chaos_failure: stream_chaos.StreamChaosError | None = None
        """A chaos check that failed where nothing could raise (a saved tensor's release)."""

    @property
    def host_bytes(self) -> int:
        """Host memory the pool has handed out since it last emptied (page-rounded)."""
        return self._pool.used_bytes

    # ------------------------------------------------------------------ forward

    def begin_forward(self) -> None:
        """Refuse a forward whose files would not fit on the disk (the last forwards' size)."""
        if self._chaos_failure is not None:
            raise self._chaos_failure
        if self.store is not None:
            self.store.check_free_space(self._expected_ssd_bytes)
        self._ssd_bytes_this_forward = 0

    def end_forward(self) -> None:
        self._expected_ssd_bytes = max(self._expected_ssd_bytes, self._ssd_bytes_this_forward)

    def send_away(self, storage: torch.UntypedStorage, block: int, mode: BlockMode) -> StoredStorage:
        """A record for ``storage`` saved in ``block``, its copy or write started."""
        source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
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
            kind = "swap_out" if mode is BlockMode.SWAP else "ssd_stage"
            record.outbound = self._submit(lambda: _copy_on_side_stream(host, source, kind, block))
            if mode is BlockMode.SWAP:
                self.stats.bytes_swapped_out += record.nbytes
        else:
            assert self.store is not None
            started = time.perf_counter()
            record.file = self.store.write(source, block=block)  # blocks while too many bytes are in flight
            self.stats.wait_s += time.perf_counter() - started
            self._count_ssd_write(record)
        return record

    def arrived(self, record: StoredStorage) -> bool:
        """Whether ``record``'s bytes have reached host memory or disk, so the original can go
        (it is dropped here); a failed copy or write raises now, in forward, rather than later."""
        if record.outbound is not None:
            if not record.outbound.query():
                return False
            record.outbound.wait()  # re-raises a failed copy
            record.outbound = None
            record.check_versions()
            record.source = None
            if record.mode is BlockMode.SSD:
                # CUDA: the bytes are staged in host memory; write them from there.
                assert record.host is not None and self.store is not None
                record.file = self.store.write(record.host, block=record.block)
                self._count_ssd_write(record)
        if record.file is not None:
            if not record.file.written():
                return False
            record.file.wait_written()  # raises SsdIoError for a failed write
            self.free_host(record)  # CUDA staging, if any
        record.check_versions()
        record.source = None
        return True

    def let_go_of_source(self, record: StoredStorage) -> None:
        """Wait until ``record``'s original may leave the device (its copy to host has landed;
        on CPU its file is written), then drop it. What bounds the device bytes in flight in
        forward: the cost model counts two offloaded blocks' worth (profiler/activation_cost.py)."""
        if record.source is None or record.released:
            return
        started = time.perf_counter()
        if record.outbound is not None:
            record.outbound.wait()  # re-raises a failed copy
        elif record.file is not None:
            record.file.wait_written()  # raises SsdIoError for a failed write
        self.arrived(record)  # drops the original (CUDA ssd: queues the write from host memory)
        self.stats.wait_s += time.perf_counter() - started

    # ------------------------------------------------------------------ backward

    def start_inbound(self, record: StoredStorage) -> None:
        """Start bringing ``record``'s bytes back to the device (a prefetch); nothing to do if
        they are back, on their way, released or lost."""
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
            self.drop_outbound(record)
            return
        if record.mode is BlockMode.SWAP or (record.mode is BlockMode.SSD and record.file is None):
            assert record.host is not None
            restored = torch.empty(record.nbytes, dtype=torch.uint8, device=record.device)
            if self._chaos:  # NaN until the copy lands: a read that misses the wait sees it
                stream_chaos.poison_(restored)
            host, block = record.host, record.block
            record.inbound = self._submit(lambda: _copy_on_side_stream(restored, host, "swap_in", block))
            record.restored = restored
            self.stats.bytes_swapped_in += record.nbytes
            return
        assert self.store is not None
        record.inbound = self.store.read(record.file)
        self.stats.bytes_from_ssd += record.nbytes

    def bytes_back(self, record: StoredStorage) -> torch.Tensor:
        """The record's bytes on the device, waiting for them if they are still on the way."""
        self.start_inbound(record)
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
            self.release_file(record)
        assert record.restored is not None
        return record.restored

    # ------------------------------------------------------------------ letting go

    def drop_outbound(self, record: StoredStorage) -> None:
        """Cancel or wait out the record's copy to host, delete its file, free its host bytes."""
        if record.outbound is not None:
            record.outbound.wait()  # the copy writes into the host buffer: let it land first
            record.outbound = None
        self.release_file(record)
        self.free_host(record)
        record.source = None

    def release_file(self, record: StoredStorage) -> None:
        """The record's file is not needed any more: the store deletes it (or cancels its write)."""
        if record.file is not None:
            assert self.store is not None
            self.store.release(record.file)
            record.file = None

    def free_host(self, record: StoredStorage) -> None:
        if record.host is None:
            return
        if self._chaos and isinstance(record.inbound, DeviceEvent):
            # A prefetched swap-in nobody will use still reads these bytes. Without chaos the
            # side stream's order keeps the next copy into them behind it; the poison is
            # written now, from this thread, so let the read finish first.
            with contextlib.suppress(RuntimeError):  # its bytes are not wanted: nor its failure
                record.inbound.wait()
        try:
            self._pool.free(record.host, written_by=record.outbound)
        except stream_chaos.StreamChaosError as err:
            self._chaos_failure = self._chaos_failure or err
            raise
        record.host = None

    def close_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()

    def _count_ssd_write(self, record: StoredStorage) -> None:
        self.stats.bytes_to_ssd += record.nbytes
        self._ssd_bytes_this_forward += record.nbytes

    def _submit(self, work: Callable[[], Any]) -> DeviceEvent:
        assert self._stream is not None
        return self._stream.submit(work)


def _copy_on_side_stream(destination: torch.Tensor, source: torch.Tensor, kind: str, block: int) -> None:
    """A swap copy, run on the side stream under its trace label (``kind``: swap_out, swap_in or
    ssd_stage; runtime/chunks/trace_labels.py). Both tensors were allocated outside it (the
    device one on the compute stream): on CUDA, record this stream's use of them (see the module
    docstring); a host tensor needs nothing, nor does anything on CPU, where the job itself
    holds them until the copy is done."""
    with job_label(kind, block):
        used_on_this_stream(destination, source)
        destination.copy_(source, non_blocking=True)
