"""Where each chunk's compute copy is: the fetch scheduling behind the residency states.

A chunk's residency is one state with a table of allowed moves (residency_states.py). A FETCHING
chunk owns a slot that the side stream is gathering into; nothing may read it or evict it until
the copy has arrived. A RESIDENT chunk's parameters point into its slot; a HOST
chunk's parameters point at a zero-byte NaN placeholder.

``ChunkResidency`` schedules the moves (DeepSpeed's ``partitioned_param_coordinator`` is the
model: fetch scheduling apart from storage and from the reducer). Non-persistent chunks borrow
one of ``n_buffer`` preallocated device slots while they are needed: a forward pre-hook on each
module that owns parameters waits for its chunks (pinned while the module runs) and prefetches
the next ``n_buffer - 1`` chunks in forward order into free slots or slots of chunks forward is
done with; backward walks the chunks in reverse and prefetches the earlier ones into slots of
chunks whose gradients are all in. A chunk still in a slot when forward ends is reused by
backward. Gathers are queued on the collective queue (side_stream.py), so every rank issues them
in one order.

Saved tensors that alias chunk memory: autograd saves views of parameters (a linear layer saves
``weight.t()``); once a slot is reused for another chunk such a view would read the wrong data,
so a view of a slot is saved as (chunk, offset, shape, stride) and re-gathered on use.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from protrain.runtime.chunks.gather import gather_shard
from protrain.runtime.chunks.residency_states import IllegalTransition, Residency
from protrain.runtime.chunks.staging import Staged, StagingRing
from protrain.runtime.chunks.trace_labels import job_label
from protrain.runtime.hw import stream_chaos
from protrain.runtime.hw.device import DeviceEvent, HostWorker, host_worker_threads, synchronize

if TYPE_CHECKING:  # store.py imports the states from here; the chunks come in as values
    from protrain.runtime.chunks.side_stream import CollectiveQueue
    from protrain.runtime.chunks.store import Chunk, ChunkStore, OffloadedChunk


@dataclass(frozen=True, slots=True)
class SavedAlias:
    """A saved tensor that views chunk memory, kept as a recipe instead of a reference."""

    chunk: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _offloaded(chunk: Chunk) -> OffloadedChunk:
    if chunk.persistent:
        raise IllegalTransition(f"chunk {chunk.index} is persistent: it never leaves the device")
    return cast("OffloadedChunk", chunk)


class ChunkResidency:
    """The device buffer slots, which chunk holds which, and when chunks move (see the module
    docstring). ``backward_done(chunk)``: whether backward will read the chunk again."""

    def __init__(
        self,
        *,
        store: ChunkStore,
        n_buffer: int,
        queue: CollectiveQueue,
        backward_done: Callable[[int], bool],
        pending_update: Callable[[int], DeviceEvent | None] = lambda _: None,
    ) -> None:
        """``pending_update(chunk)``: the host worker's update of the chunk still running, if
        any (two-phase step): its gather waits for it, on the side stream."""
        self.store = store
        self.chunks = store.chunks
        self.n_buffer = n_buffer
        self.queue = queue
        self.backward_done = backward_done
        self.pending_update = pending_update
        self.slots = [
            torch.empty(store.layout.chunk_numel, dtype=store.compute_dtype, device=store.device.device)
            for _ in range(n_buffer)
        ]
        self._chaos = stream_chaos.enabled()
        """Stream chaos: a slot is NaN whenever no chunk's data has landed in it, so compute
        reading a slot through a missing wait sees NaN."""
        for slot in self.slots if self._chaos else ():
            stream_chaos.poison_(slot)
        self._slot_owner: list[int | None] = [None] * n_buffer
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._slot_storage = {slot.untyped_storage().data_ptr(): i for i, slot in enumerate(self.slots)}
        self._pinned: set[int] = set()
        self._held: dict[int, int] = {}
        """Chunks held on the device by ``hold`` (engine.gathered), with how many holds each:
        pinned whatever modules run, until let go."""
        self._refreshed_early: set[int] = set()
        """Persistent chunks whose refresh the step queued early (``refresh_early``)."""
        self._recomputing = False
        self._privatized: set[int] = set()
        self._stand_ins: list[tuple[nn.Module, str, nn.Parameter]] = []
        """Frozen parameters replaced in their modules while a block is recomputed."""
        self._fetches: dict[int, DeviceEvent] = {}
        offloaded_fp32 = any(not c.persistent and c.master.dtype != store.compute_dtype for c in self.chunks)
        self.uploads = (
            StagingRing(numel=store.layout.shard_numel, dtype=store.compute_dtype, pin=store.device.is_cuda)
            if offloaded_fp32
            else None
        )
        """Host buffers fp32 master shards are downcast into for upload (compute dtype not fp32)."""
        self._downcasts = (
            HostWorker("protrain-uploads", threads=host_worker_threads(store.device))
            if self.uploads is not None
            else None
        )
        """The host thread that downcasts masters into upload staging: the side stream's thread
        only issues copies and collectives, so a host stall never becomes a device bubble. Not
        the host worker: in a two-phase step its queue holds every chunk's update, and a fetch
        must wait for its own chunk's update only."""
        self.prefetch_depth = 0 if n_buffer <= 1 else n_buffer - 1
        self.num_gathers = 0
        """Gathers of non-persistent chunks into slots (a chunk reused from its slot is not one)."""
        self._profiling = False
        self.stall_s = 0.0
        """Seconds compute waited for chunks during the last ``profiling`` window."""
        self._handles: list[Any] = []

    # ------------------------------------------------------------------ moves

    def ensure_resident(self, chunk_index: int) -> torch.Tensor:
        """The chunk's full compute copy: waits for its prefetch, or gathers it now into a slot
        (evicting the least recently used chunk that is neither pinned nor in flight)."""
        chunk = self.chunks[chunk_index]
        if chunk.residency is Residency.HOST:
            slot = self._free_slot(evict=True)
            assert slot is not None
            self._start_fetch(chunk, slot)
        if chunk.residency is Residency.FETCHING:
            self.queue.make_compute_wait(self._fetches.pop(chunk_index))
            chunk.move(Residency.RESIDENT)
            self.store.point_params(chunk)
        if not chunk.persistent:
            self._lru.move_to_end(chunk_index)
        full = chunk.full
        assert full is not None
        return full

    def prefetch(self, chunk_indices: Sequence[int], *, evictable: Callable[[int], bool]) -> None:
        """Start gathering these chunks on the side stream, in order, while slots allow: a free
        slot, or one whose chunk ``evictable`` allows (never a pinned or in-flight chunk)."""
        for chunk_index in chunk_indices:
            chunk = self.chunks[chunk_index]
            if chunk.residency is not Residency.HOST:
                continue
            slot = self._free_slot(evict=False)
            if slot is None:
                victim = next(
                    (
                        c
                        for c in self._lru
                        if c not in self._pinned
                        and c != chunk_index
                        and evictable(c)
                        and self.chunks[c].residency is Residency.RESIDENT
                    ),
                    None,
                )
                if victim is None:
                    return
                self.evict(victim)
                slot = self._free_slot(evict=False)
            assert slot is not None
            self._start_fetch(chunk, slot)

    def _start_fetch(self, chunk: Chunk, slot: int) -> None:
        full = self.slots[slot]
        _offloaded(chunk).hold(slot, full)
        self._slot_owner[slot] = chunk.index
        self._lru[chunk.index] = None
        master = chunk.master
        staged = self.uploads.assign() if self.uploads is not None and master.dtype != full.dtype else None
        # The chunk's two-phase update on the host worker, if still running: the master is read after it.
        ready = self.pending_update(chunk.index)
        if staged is not None:
            ready = self._downcast(chunk.index, master, staged, ready)

        def fetch() -> None:
            if ready is not None:
                ready.wait()  # what this job uploads is in place (updated, downcast)
            with job_label("gather", chunk.index):
                self.gather_shard(master, full, staged=staged)

        fetched = self.queue.submit(fetch)
        if staged is not None:
            assert self.uploads is not None
            self.uploads.released_by(staged, fetched)
        self._fetches[chunk.index] = fetched
        self.num_gathers += 1

    def _downcast(
        self, chunk_index: int, master: torch.Tensor, staged: Staged, updated: DeviceEvent | None
    ) -> DeviceEvent:
        """Queue the fp32 master's downcast into ``staged`` on the upload thread, after the
        chunk's update and once the buffer's last upload has left; its event."""
        assert self._downcasts is not None

        def downcast() -> None:
            if updated is not None:
                updated.wait()
            staged.wait_until_free()
            with torch.no_grad(), job_label("downcast", chunk_index):
                staged.buffer[: master.numel()].copy_(master)

        return self._downcasts.submit(downcast)

    def _free_slot(self, *, evict: bool) -> int | None:
        for slot, owner in enumerate(self._slot_owner):
            if owner is None:
                return slot
        if not evict:
            return None
        for victim in self._lru:
            if victim not in self._pinned and self.chunks[victim].residency is Residency.RESIDENT:
                self.evict(victim)
                return self._free_slot(evict=False)
        for victim in self._lru:
            # Only prefetches hold the other slots: the chunk needed now goes first, so let one
            # land and give its slot up (it is fetched again when its turn comes).
            if victim not in self._pinned and self.chunks[victim].residency is Residency.FETCHING:
                self.ensure_resident(victim)
                self.evict(victim)
                return self._free_slot(evict=False)
        raise RuntimeError(f"all {self.n_buffer} chunk buffers are pinned; n_buffer is too small")

    def evict(self, chunk_index: int) -> None:
        chunk = _offloaded(self.chunks[chunk_index])
        slot = chunk.release()
        self._slot_owner[slot] = None
        if self._chaos:
            stream_chaos.poison_(self.slots[slot])
        self._lru.pop(chunk_index, None)
        self.store.point_params(chunk)

    def gather_shard(self, master: torch.Tensor, out: torch.Tensor, *, staged: Staged | None = None) -> None:
        """``gather.gather_shard`` for this engine's chunks: on the side stream (the one thread
        that issues collectives) or, for persistent chunks, after the stream has drained."""
        gather_shard(self.store, master, out, staged=staged)

    def refresh_early(self, chunk_index: int) -> None:
        """In the step, right after a sharded persistent chunk's update (every rank calls it
        for the same chunks in the same order): its all-gather goes to the side stream, under
        the next chunks' updates instead of after all of them; ``refresh`` leaves it alone."""
        chunk = self.chunks[chunk_index]
        sharded = chunk.persistent and chunk.info.trainable and not chunk.is_replicated
        if sharded and self.store.dist_ctx.world_size > 1:
            master, full = chunk.master, chunk.full
            self.queue.submit(lambda: self._labelled_gather(chunk_index, master, full))
            self._refreshed_early.add(chunk_index)

    @torch.no_grad()
    def _labelled_gather(self, chunk_index: int, master: torch.Tensor, full: torch.Tensor | None) -> None:
        assert full is not None
        with job_label("gather", chunk_index):
            self.gather_shard(master, full)

    @torch.no_grad()
    def refresh(self, *, frozen_too: bool) -> None:
        """After an update (the queue drained): re-gather persistent chunks (those not gathered
        early); drop every buffered copy of the others (including prefetches that arrived with
        pre-update data)."""
        early, self._refreshed_early = self._refreshed_early, set()
        for chunk in self.chunks:
            if chunk.index in early:
                continue
            if chunk.persistent and (chunk.info.trainable or frozen_too):
                full = chunk.full
                assert full is not None
                if chunk.is_replicated:  # its own master is the whole chunk: no collective
                    if chunk.master.data_ptr() != full.data_ptr():
                        full[: chunk.master.numel()].copy_(chunk.master)
                # One rank whose shard is its full copy (fp32, or a frozen chunk) has nothing to do.
                elif self.store.dist_ctx.world_size > 1 or chunk.master.data_ptr() != full.data_ptr():
                    self.gather_shard(chunk.master, full)
            elif chunk.residency is Residency.FETCHING:
                self.ensure_resident(chunk.index)
                self.evict(chunk.index)
            elif chunk.residency is Residency.RESIDENT:
                self.evict(chunk.index)

    def hold(self, chunk_indices: Sequence[int]) -> None:
        """Bring these chunks to the device and keep them there until ``let_go`` (nested holds
        count): a read of their parameters outside their modules' forward (engine.gathered)."""
        for chunk_index in chunk_indices:
            self._held[chunk_index] = self._held.get(chunk_index, 0) + 1
            self._pinned.add(chunk_index)
        if chunk_indices:
            self._wait_for(chunk_indices)

    def let_go(self, chunk_indices: Sequence[int]) -> None:
        """The end of a ``hold``: the chunks stay resident, evictable as any other."""
        for chunk_index in chunk_indices:
            self._held[chunk_index] -= 1
            if not self._held[chunk_index]:
                del self._held[chunk_index]
                self._pinned.discard(chunk_index)

    def resident_chunks(self) -> list[int]:
        return [c.index for c in self.chunks if c.residency is Residency.RESIDENT]

    def unpin(self) -> None:
        self._pinned = set(self._held)

    # ------------------------------------------------------------------ forward and recompute

    def install_hooks(self, model: nn.Module) -> None:
        # With every chunk persistent nothing moves: no gathers to trigger in forward.
        offloaded = any(not chunk.persistent for chunk in self.chunks)
        for module in model.modules() if offloaded else ():
            owned = sorted({self.store.chunk_of(p) for p in module.parameters(recurse=False)})
            if owned:
                self._handles.append(module.register_forward_pre_hook(self._make_pre_forward(owned)))

    def _make_pre_forward(self, owned: list[int]) -> Any:
        def pre_forward(module: nn.Module, _inputs: Any) -> None:
            self._pinned = set(owned) | self._held.keys()
            self._wait_for(owned)
            if self._recomputing:
                # The block's forward runs again inside backward: no prefetch in either
                # direction would be right for long, so fetch on demand only.
                self._privatize(module)
                return
            # Forward walks the chunks in index order: fetch the next ones now, reusing slots of
            # chunks forward is done with.
            low = min(owned)
            upcoming = [c for c in range(max(owned) + 1, len(self.chunks)) if not self.chunks[c].persistent]
            self.prefetch(upcoming[: self.prefetch_depth], evictable=lambda c: c < low)

        return pre_forward

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        """A checkpointed block's forward runs again inside backward. Its saved tensors are kept
        by ``torch.utils.checkpoint`` itself, out of reach of ``pack_alias``: the parameters it
        reads from buffer slots are pointed at private copies meanwhile, so a slot reused before
        that block's backward ends cannot change what it saved."""
        self._recomputing = True
        try:
            yield
        finally:
            self._recomputing = False
            self._pinned = set(self._held)
            for chunk_index in self._privatized:
                self.store.point_params(self.chunks[chunk_index])
            self._privatized.clear()
            for module, name, original in self._stand_ins:
                module._parameters[name] = original
            self._stand_ins.clear()

    def _privatize(self, module: nn.Module) -> None:
        """The module's parameters that live in buffer slots read private copies while the
        block is recomputed. checkpoint saves a trainable parameter as a detached alias of its
        data then (the copy, whatever the parameter points at later), but a frozen one as the
        parameter itself, which points back at a slot (or the placeholder) once the
        recomputation ends: a frozen one is replaced in its module by a parameter of its own,
        the original put back afterwards."""
        for name, param in list(module.named_parameters(recurse=False)):
            chunk_index = self.store.chunk_of(param)
            if self.chunks[chunk_index].persistent:
                continue
            if param.requires_grad:
                param.data = param.data.clone()
                self._privatized.add(chunk_index)
            else:
                module._parameters[name] = nn.Parameter(param.data.clone(), requires_grad=False)
                self._stand_ins.append((module, name, param))

    # ------------------------------------------------------------------ saved views of slots

    def pack_alias(self, tensor: torch.Tensor) -> SavedAlias | None:
        """A recipe for a saved tensor that views a chunk buffer slot (its memory may hold
        another chunk by the time backward reads it), or None for any other tensor."""
        if not self.slots:
            return None
        slot = self._slot_storage.get(tensor.untyped_storage().data_ptr())
        if slot is None:
            return None
        owner = self._slot_owner[slot]
        assert owner is not None, "a saved tensor views an empty chunk buffer"
        return SavedAlias(owner, int(tensor.storage_offset()), tuple(tensor.size()), tuple(tensor.stride()))

    def unpack_alias(self, packed: SavedAlias) -> torch.Tensor:
        full = self._wait_for([packed.chunk])
        self._prefetch_backward(packed.chunk)
        return full.as_strided(packed.size, packed.stride, packed.offset)

    def _prefetch_backward(self, chunk_index: int) -> None:
        """Backward walks the chunks in reverse: fetch the ones before ``chunk_index``, into
        slots of chunks whose gradients are all in (backward will not read them again)."""
        if self.prefetch_depth:
            earlier = [c for c in range(chunk_index - 1, -1, -1) if not self.chunks[c].persistent]
            self.prefetch(earlier[: self.prefetch_depth], evictable=self.backward_done)

    def slot_storages(self) -> set[int]:
        return set(self._slot_storage)

    # ------------------------------------------------------------------ profiling

    def begin_profiling(self) -> None:
        """Every gather on demand (no prefetch) and synchronous, its seconds in ``stall_s``."""
        self._profiling = True
        self.stall_s = 0.0
        self._saved_prefetch_depth, self.prefetch_depth = self.prefetch_depth, 0

    def end_profiling(self) -> None:
        self._profiling = False
        self.prefetch_depth = self._saved_prefetch_depth
        self._pinned = set(self._held)

    def _wait_for(self, chunk_indices: Sequence[int]) -> torch.Tensor:
        """Make these chunks resident (compute waits here); the last one's full copy. While
        profiling, the wait is synchronous and counted in ``stall_s``."""
        full: torch.Tensor | None = None
        started = 0.0
        device = self.store.device
        if self._profiling:
            synchronize(device)
            started = time.perf_counter()
        try:
            for chunk_index in chunk_indices:
                full = self.ensure_resident(chunk_index)
            if self._profiling:
                synchronize(device)
        finally:
            if self._profiling:
                self.stall_s += time.perf_counter() - started
        assert full is not None, "no chunk to wait for"
        return full

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._downcasts is not None:
            self._downcasts.close()
        if self.uploads is not None:
            self.uploads.close()
