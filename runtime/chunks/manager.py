"""Model state in chunks: ZeRO-3 shards, persistent chunks, device buffers, gradient reduction.

Each chunk of the layout is one flat buffer of ``chunk_numel`` elements, split evenly over the
ranks. This rank keeps its shard in fp32 (master weights, gradient) with the optimizer state:
on the device for the first ``n_persist`` chunks, in host memory for the others. Compute uses a
full, all-gathered copy in the compute dtype: persistent chunks own one for the whole run;
the others borrow one of ``n_buffer`` preallocated device slots while they are needed.

Parameters are ordinary ``nn.Parameter`` objects whose ``.data`` points into the chunk's full
copy while it is resident. When a chunk leaves its slot, its parameters point at a zero-byte
placeholder of the right shape filled with NaN (a stride-0 expansion of one element): autograd's
gradient accumulation needs the parameter's shape even when its data is gone, and a stray read
gives NaN, which the engine's non-finite check turns into an error.

Transfers: one side stream (a worker thread on CPU) issues every collective in program order,
so all ranks pair them up: gathers ahead of use (prefetch) and reduce-scatters during backward.
The main thread only issues collectives after draining it. With offloaded chunks every rank must
therefore run the same modules in a step (as with any ZeRO-3 implementation).

Gradients: a hook after each parameter's gradient accumulation copies the gradient into the
chunk's gradient buffer (one rank in fp32: straight into the fp32 shard), taken from a small pool
that hands a buffer back once its reduction has run (grad_buffers.py); when every trainable
parameter of a chunk has reported, the chunk is ready. Ready chunks are reduce-scattered into
the fp32 shard gradient strictly in reverse chunk order, the same on every rank (chunks left
incomplete by unused parameters are flushed, in that order, when backward ends).

Optimizer: persistent chunks are updated at the accumulation boundary. Offloaded chunks are
updated on a CPU-Adam thread during the window's last backward, as soon as their gradient is
reduced (speculative: the global norm is not known yet). The ranks agree before that backward
whether any saw a non-finite loss (then the step is skipped and nothing is updated early). With
gradient clipping on, a snapshot of what the update changes is kept in the host arena and
restored, and the update redone, when the clip triggers; without clipping nothing can undo an
early update, so no snapshot is taken (no memory, no copy). A segment that had no gradient here
but had one on another rank is updated at the boundary. Measured on CPU
(scripts/bench_offload.py): exposed optimizer time 0.0004 s/step speculative vs 0.042 s/step
deferred, for 13 chunks of 7.3 MiB; with clipping the cost is one snapshot copy per update,
plus a redo when the clip triggers. fp16 defers (its gradients are still scaled and often
overflow).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runtime.chunks.grad_buffers import GradientBufferPool
from runtime.chunks.layout import ChunkInfo, ChunkLayout
from runtime.chunks.residency import Residency, check_move
from runtime.cpu_adam import ShardAdamW
from runtime.device import DeviceEvent, DeviceInfo, MmapArena, SideStream, synchronize
from runtime.distributed import DistContext, all_gather_flat, all_reduce_sum_, reduce_scatter_flat_


@dataclass(frozen=True, slots=True)
class Segment:
    """The part of one parameter that lies in this rank's shard of a chunk."""

    param: int
    shard_offset: int
    param_offset: int
    numel: int


def shard_segments(layout: ChunkLayout, chunk: ChunkInfo, rank: int) -> list[Segment]:
    shard = layout.shard_numel
    lo, hi = rank * shard, (rank + 1) * shard
    segments = []
    for index in chunk.params:
        start = layout.slots[index].offset
        end = start + layout.params[index].numel
        a, b = max(lo, start), min(hi, end)
        if a < b:
            segments.append(Segment(param=index, shard_offset=a - lo, param_offset=a - start, numel=b - a))
    return segments


@dataclass(frozen=True, slots=True)
class SavedAlias:
    """A saved tensor that views chunk memory, kept as a recipe instead of a reference."""

    chunk: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class Chunk:
    """One chunk's state on this rank."""

    def __init__(self, info: ChunkInfo, *, persistent: bool) -> None:
        self.info = info
        self.index = info.index
        self.persistent = persistent
        self.residency = Residency.PERSISTENT if persistent else Residency.HOST
        self.full: torch.Tensor | None = None
        self.slot: int | None = None
        self.master: torch.Tensor | None = None
        """fp32 shard (trainable chunks) or compute-dtype shard (frozen chunks)."""
        self.grad_shard: torch.Tensor | None = None
        self.segments: list[Segment] = []
        self.optimizer: ShardAdamW | None = None
        self.snapshot: tuple[torch.Tensor, ...] | None = None
        """Host copies of (master, exp_avg, exp_avg_sq, steps) taken before a speculative update."""
        self.speculated_active: list[bool] | None = None
        """The per-segment activity a speculative update assumed; None: not updated this window."""
        self.speculation_undoable = False
        """Whether ``snapshot`` holds the state from before this window's speculative update."""

    def move(self, target: Residency) -> None:
        self.residency = check_move(self.index, self.residency, target)


class ChunkManager:
    """Owns every chunk, the device slots and the hooks that move data; see module docstring."""

    def __init__(
        self,
        *,
        model: nn.Module,
        layout: ChunkLayout,
        n_persist: int,
        n_buffer: int,
        compute_dtype: torch.dtype,
        device: DeviceInfo,
        dist_ctx: DistContext,
        weight_decay: Sequence[float],
        betas: tuple[float, float],
        eps: float,
        lr: float,
        undo_snapshots: bool = True,
        read_param: Callable[[str], torch.Tensor] | None = None,
    ) -> None:
        """``read_param(name)``, when given, supplies each parameter's value while its chunk is
        built (the model holds only stand-ins: weights streamed from a file, one at a time)."""
        self.model = model
        self.layout = layout
        self.compute_dtype = compute_dtype
        self.device = device
        self.dist_ctx = dist_ctx
        self.params = [model.get_parameter(info.name) for info in layout.params]
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        self.chunk_of_param = [slot.chunk for slot in layout.slots]
        self.chunks = [Chunk(info, persistent=info.index < n_persist) for info in layout.chunks]
        self.n_buffer = n_buffer
        self._check_buffers()
        self.undo_snapshots = undo_snapshots
        """Snapshot what an early (speculative) update changes so it can be undone: needed only
        when gradient clipping is on (see begin_last_backward)."""
        self._read_param = read_param
        self.host_arena = self._build_host_arena()
        self._build_storage(weight_decay, betas=betas, eps=eps, lr=lr)
        self.slots = [
            torch.empty(layout.chunk_numel, dtype=compute_dtype, device=device.device)
            for _ in range(n_buffer)
        ]
        self._slot_owner: list[int | None] = [None] * n_buffer
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._slot_storage = {slot.untyped_storage().data_ptr(): i for i, slot in enumerate(self.slots)}
        self._pinned: set[int] = set()
        self._recomputing = False
        self._privatized: set[int] = set()
        self._nan: torch.Tensor | None = None
        for chunk in self.chunks:
            self._point_params(chunk)
            self._point_grads(chunk)
        self._grad_buffers: dict[int, torch.Tensor] = {}
        """The gradient buffer each chunk is filling (taken from ``_grad_pool``)."""
        self._remaining = [0] * len(self.chunks)
        self._fired = torch.zeros(len(self.params), dtype=torch.bool)
        self._fired_in_window = torch.zeros(len(self.params), dtype=torch.bool)
        self._reduce_order = [c.index for c in reversed(self.chunks) if c.info.trainable]
        self._next_reduction = 0
        self.stream = SideStream(device, name="protrain-chunks")
        """The one thread (CUDA: stream) that issues every collective, in program order."""
        self._grad_pool = GradientBufferPool(
            numel=layout.chunk_numel, dtype=compute_dtype, device=device, stream=self.stream
        )
        self._fetches: dict[int, DeviceEvent] = {}
        self._last_submitted: DeviceEvent | None = None
        self.prefetch_depth = 0 if n_buffer <= 1 else n_buffer - 1
        self.speculative_cpu_adam = True
        """Update offloaded chunks during the window's last backward, as soon as their gradient
        is reduced (see begin_last_backward); False defers every update to the accumulation
        boundary."""
        self._cpu_adam = SideStream(DeviceInfo(torch.device("cpu"), "gloo"), name="protrain-cpu-adam")
        self._speculation_lr: float | None = None
        self._speculation_allowed: tuple[DeviceEvent, torch.Tensor] | None = None
        self._last_adam: DeviceEvent | None = None
        self.num_gathers = 0
        """Gathers of non-persistent chunks into slots (a chunk reused from its slot is not one)."""
        self.num_speculations = 0
        self.num_restores = 0
        """Speculative chunk updates undone from their snapshot (a triggering clip)."""
        self._profiling = False
        self.stall_s = 0.0
        """Seconds compute waited for chunks during the last ``profiling`` window."""
        self._handles: list[Any] = []
        self._install_hooks()
        self.reset_backward()

    # ------------------------------------------------------------------ building

    def _check_buffers(self) -> None:
        offloaded = [c for c in self.chunks if not c.persistent]
        if not offloaded:
            return
        need = 1
        owner = ""
        for name, module in self.model.named_modules():
            chunks = {self.chunk_of_param[self._index_of[id(p)]] for p in module.parameters(recurse=False)}
            count = sum(1 for c in chunks if not self.chunks[c].persistent)
            if count > need:
                need, owner = count, name
        if self.n_buffer < need:
            where = (
                f"module {owner!r} uses {need} non-persistent chunks at once" if owner else "one is needed"
            )
            raise ValueError(
                f"memory.n_buffer={self.n_buffer} is too few: {where}; set memory.n_buffer >= {need} "
                f"or raise memory.n_persist"
            )

    def _build_host_arena(self) -> MmapArena | None:
        offloaded = [c for c in self.chunks if not c.persistent]
        if not offloaded:
            return None
        # fp32 master, gradient, two Adam moments and, when early updates may be undone, the
        # snapshot of master and moments, per offloaded chunk's shard, each rounded up to a page
        # (frozen chunks need less; unused arena is only address space, but pinned on CUDA).
        shard_bytes = self.layout.shard_numel * 4 + 4096
        per_chunk = 7 if self.undo_snapshots else 4
        return MmapArena(len(offloaded) * per_chunk * shard_bytes, pin=self.device.is_cuda)

    def _build_storage(
        self, weight_decay: Sequence[float], *, betas: tuple[float, float], eps: float, lr: float
    ) -> None:
        """Copy each parameter into its chunk; keep this rank's shard; give up the originals."""
        rank, shard = self.dist_ctx.rank, self.layout.shard_numel
        target_device = self.device.device
        for chunk in self.chunks:
            flat = torch.zeros(self.layout.chunk_numel, dtype=torch.float32)
            for index in chunk.info.params:
                offset = self.layout.slots[index].offset
                param = self.params[index]
                if self._read_param is not None:
                    value = self._read_param(self.layout.params[index].name)
                else:
                    value = param.detach()
                flat[offset : offset + param.numel()].copy_(value.reshape(-1))
                del value  # a streamed value lives only until it is in its chunk
            mine = flat[rank * shard : (rank + 1) * shard]
            chunk.segments = shard_segments(self.layout, chunk.info, rank)
            if chunk.persistent:
                chunk.full = flat.to(device=target_device, dtype=self.compute_dtype)
            if not chunk.info.trainable:
                chunk.master = self._place(mine.to(self.compute_dtype), chunk.persistent)
                continue
            if self._master_is_full_copy(chunk):
                # One rank, fp32 compute: the full copy already is the fp32 shard; keep one.
                assert chunk.full is not None
                chunk.master = chunk.full
            else:
                chunk.master = self._place(mine, chunk.persistent)
            chunk.grad_shard = self._place(torch.zeros(shard), chunk.persistent)
            moments = (
                self._place(torch.zeros(shard), chunk.persistent),
                self._place(torch.zeros(shard), chunk.persistent),
            )
            chunk.optimizer = ShardAdamW(
                chunk.master,
                [(s.shard_offset, s.numel, weight_decay[s.param]) for s in chunk.segments],
                lr=lr,
                betas=betas,
                eps=eps,
                moments=moments,
            )

    def _master_is_full_copy(self, chunk: Chunk) -> bool:
        return chunk.persistent and self.dist_ctx.world_size == 1 and self.compute_dtype == torch.float32

    def _direct_grads(self, chunk: Chunk) -> bool:
        """One rank, fp32 compute, shard gradient on the compute device: there is nothing to
        reduce, so gradients accumulate straight into the fp32 shard."""
        grad_shard = chunk.grad_shard
        return (
            self.dist_ctx.world_size == 1
            and self.compute_dtype == torch.float32
            and grad_shard is not None
            and grad_shard.device == self.device.device
        )

    def _place(self, tensor: torch.Tensor, persistent: bool) -> torch.Tensor:
        if persistent or self.host_arena is None:
            return tensor.to(self.device.device).clone() if persistent else tensor.clone()
        out = self.host_arena.allocate(tensor.numel(), tensor.dtype)
        out.copy_(tensor)
        return out

    # ------------------------------------------------------------------ residency

    def _placeholder(self, param: nn.Parameter) -> torch.Tensor:
        if self._nan is None:
            self._nan = torch.full((1,), float("nan"), dtype=self.compute_dtype, device=self.device.device)
        return self._nan.expand(param.shape) if param.dim() else self._nan[0]

    def _point_grads(self, chunk: Chunk) -> None:
        """Direct-gradient chunks: each parameter's ``.grad`` is its slice of the fp32 shard, so
        autograd accumulates into the shard in place (no copy pass over the gradients)."""
        if not self._direct_grads(chunk):
            return
        assert chunk.grad_shard is not None
        for index in chunk.info.params:
            param = self.params[index]
            if param.requires_grad:
                offset = self.layout.slots[index].offset
                param.grad = chunk.grad_shard[offset : offset + param.numel()].view(param.shape)

    def _point_params(self, chunk: Chunk) -> None:
        for index in chunk.info.params:
            param = self.params[index]
            if chunk.full is None:
                param.data = self._placeholder(param)
            else:
                offset = self.layout.slots[index].offset
                param.data = chunk.full[offset : offset + param.numel()].view(param.shape)

    def ensure_resident(self, chunk_index: int) -> torch.Tensor:
        """The chunk's full compute copy: waits for its prefetch, or gathers it now into a slot
        (evicting the least recently used chunk that is neither pinned nor in flight)."""
        chunk = self.chunks[chunk_index]
        if chunk.residency is Residency.HOST:
            self._start_fetch(chunk, self._free_slot(evict=True))
        if chunk.residency is Residency.FETCHING:
            self.stream.make_compute_wait(self._fetches.pop(chunk_index))
            chunk.move(Residency.RESIDENT)
            self._point_params(chunk)
        if not chunk.persistent:
            self._lru.move_to_end(chunk_index)
        assert chunk.full is not None
        return chunk.full

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
        chunk.move(Residency.FETCHING)
        chunk.full, chunk.slot = full, slot
        self._slot_owner[slot] = chunk.index
        self._lru[chunk.index] = None
        master = chunk.master
        assert master is not None
        self._fetches[chunk.index] = self._submit(lambda: self._gather_shard(master, full))
        self.num_gathers += 1

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
        chunk = self.chunks[chunk_index]
        chunk.move(Residency.HOST)
        assert chunk.slot is not None
        self._slot_owner[chunk.slot] = None
        chunk.full, chunk.slot = None, None
        self._lru.pop(chunk_index, None)
        self._point_params(chunk)

    def _gather(self, chunk: Chunk, out: torch.Tensor) -> None:
        assert chunk.master is not None
        self._gather_shard(chunk.master, out)

    def _gather_shard(self, master: torch.Tensor, out: torch.Tensor) -> None:
        """Upload this rank's shard in the compute dtype and all-gather the full chunk into
        ``out``. Runs on the side stream (the one thread that issues collectives) or, for
        persistent chunks, after the stream has drained."""
        shard = master.to(device=self.device.device, dtype=self.compute_dtype, non_blocking=True)
        if self.dist_ctx.world_size == 1:
            out.copy_(shard)
        else:
            all_gather_flat(out, shard, self.dist_ctx.group)

    def resident_chunks(self) -> list[int]:
        return [c.index for c in self.chunks if c.residency is Residency.RESIDENT]

    # ------------------------------------------------------------------ hooks

    def _install_hooks(self) -> None:
        # With every chunk persistent nothing moves: no gathers to trigger in forward.
        offloaded = any(not chunk.persistent for chunk in self.chunks)
        for module in self.model.modules() if offloaded else ():
            owned = sorted(
                {self.chunk_of_param[self._index_of[id(p)]] for p in module.parameters(recurse=False)}
            )
            if owned:
                self._handles.append(module.register_forward_pre_hook(self._make_pre_forward(owned)))
        for index, param in enumerate(self.params):
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(self._make_grad_hook(index)))

    def _make_pre_forward(self, owned: list[int]) -> Any:
        def pre_forward(module: nn.Module, _inputs: Any) -> None:
            self._pinned = set(owned)
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

    def _make_grad_hook(self, index: int) -> Any:
        def on_grad(param: nn.Parameter) -> None:
            self._accept_grad(index, param)

        return on_grad

    @torch.no_grad()
    def _accept_grad(self, index: int, param: nn.Parameter) -> None:
        assert param.grad is not None
        chunk_index = self.chunk_of_param[index]
        chunk = self.chunks[chunk_index]
        if self._profiling:
            # A profiling step's gradient is dropped (a direct one is zeroed afterwards).
            if not self._direct_grads(chunk):
                param.grad = None
            return
        if self._direct_grads(chunk):
            # Autograd accumulated in place into the shard slice that is this parameter's
            # .grad; anything else means the view was replaced (e.g. set to None by hand).
            if not self._grad_is_shard_view(index, param):
                raise RuntimeError(
                    f"{self.layout.params[index].name}.grad no longer views its gradient shard; "
                    "do not set or replace .grad of a model the engine trains (use engine.step)"
                )
        else:
            buffer = self._grad_buffers.get(chunk_index)
            if buffer is None:
                buffer = self._grad_buffers[chunk_index] = self._grad_pool.take()
            offset = self.layout.slots[index].offset
            buffer[offset : offset + param.numel()].add_(param.grad.reshape(-1))
            param.grad = None
        if not self._fired[index]:
            self._fired[index] = True
            self._fired_in_window[index] = True
            self._remaining[chunk_index] -= 1
            if self._remaining[chunk_index] == 0:
                self._issue_ready_reductions()

    def _grad_is_shard_view(self, index: int, param: nn.Parameter) -> bool:
        grad_shard = self.chunks[self.chunk_of_param[index]].grad_shard
        assert param.grad is not None and grad_shard is not None
        offset = self.layout.slots[index].offset * grad_shard.element_size()
        return (
            param.grad.untyped_storage().data_ptr() == grad_shard.untyped_storage().data_ptr()
            and param.grad.storage_offset() * param.grad.element_size()
            == grad_shard.storage_offset() * grad_shard.element_size() + offset
        )

    def end_forward(self) -> None:
        """Forward is over: no module's chunks need to stay put any more (backward may evict)."""
        self._pinned = set()

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
        return SavedAlias(owner, tensor.storage_offset(), tuple(tensor.size()), tuple(tensor.stride()))

    def unpack_alias(self, packed: SavedAlias) -> torch.Tensor:
        full = self._wait_for([packed.chunk])
        self._prefetch_backward(packed.chunk)
        return full.as_strided(packed.size, packed.stride, packed.offset)

    def _prefetch_backward(self, chunk_index: int) -> None:
        """Backward walks the chunks in reverse: fetch the ones before ``chunk_index``, into
        slots of chunks whose gradients are all in (backward will not read them again)."""
        if self.prefetch_depth:
            earlier = [c for c in range(chunk_index - 1, -1, -1) if not self.chunks[c].persistent]
            self.prefetch(earlier[: self.prefetch_depth], evictable=self._backward_done)

    def model_state_storages(self) -> set[int]:
        """Storage addresses of chunk memory (slots, persistent copies, shards): a saved tensor
        in one of them is model state, never an activation to swap or write to disk."""
        storages = set(self._slot_storage)
        for chunk in self.chunks:
            for tensor in (chunk.full if chunk.persistent else None, chunk.master, chunk.grad_shard):
                if tensor is not None:
                    storages.add(tensor.untyped_storage().data_ptr())
        return storages

    def device_state_bytes(self) -> int:
        """Bytes of chunk state on the compute device (persistent copies and their fp32 state,
        the buffers), each storage once: the static part of the device peak."""
        seen: set[int] = set()
        total = 0
        tensors: list[torch.Tensor | None] = list(self.slots)
        for chunk in self.chunks:
            tensors += [chunk.full, chunk.master, chunk.grad_shard]
            if chunk.optimizer is not None:
                tensors += [chunk.optimizer.exp_avg, chunk.optimizer.exp_avg_sq]
        for tensor in tensors:
            if tensor is None or tensor.device != self.device.device or self._in_host_arena(tensor):
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    def _in_host_arena(self, tensor: torch.Tensor) -> bool:
        return self.host_arena is not None and self.host_arena.contains(tensor)

    @contextlib.contextmanager
    def profiling(self) -> Iterator[None]:
        """Profiling steps run through the chunk engine as training does (chunks gathered in
        forward, saved views of buffer slots re-gathered in backward), so a model whose state
        does not fit the device is profiled too; but their gradients are dropped: nothing is
        reduced or updated. Every gather happens on demand (no prefetch) and synchronously, and
        its seconds are counted in ``stall_s`` for the profiler to take off its clock: a
        prefetch in flight would otherwise be waited for inside a block's time (on CUDA any
        synchronisation waits for the side stream too) and count as compute. Backward reuses
        slots as usual but, with no gradient reported, never evicts ahead. Afterwards the
        gradients are zero and a clean window begins."""
        self.drain()
        self._profiling = True
        self.stall_s = 0.0
        prefetch_depth, self.prefetch_depth = self.prefetch_depth, 0
        try:
            yield
        finally:
            self._profiling = False
            self.prefetch_depth = prefetch_depth
            self._pinned = set()
            try:
                self.drain()
            finally:
                self._grad_buffers.clear()
                self._grad_pool.release()
                for chunk in self.chunks:
                    if not self._direct_grads(chunk):
                        for index in chunk.info.params:
                            self.params[index].grad = None
                    self._point_grads(chunk)
                self.zero_grad()
                self.reset_backward()

    def _wait_for(self, chunk_indices: Sequence[int]) -> torch.Tensor:
        """Make these chunks resident (compute waits here); the last one's full copy. While
        profiling, the wait is synchronous and counted in ``stall_s``."""
        full: torch.Tensor | None = None
        started = 0.0
        if self._profiling:
            synchronize(self.device)
            started = time.perf_counter()
        try:
            for chunk_index in chunk_indices:
                full = self.ensure_resident(chunk_index)
            if self._profiling:
                synchronize(self.device)
        finally:
            if self._profiling:
                self.stall_s += time.perf_counter() - started
        assert full is not None, "no chunk to wait for"
        return full

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
            self._pinned = set()
            for chunk_index in self._privatized:
                self._point_params(self.chunks[chunk_index])
            self._privatized.clear()

    def _privatize(self, module: nn.Module) -> None:
        for param in module.parameters(recurse=False):
            chunk_index = self.chunk_of_param[self._index_of[id(param)]]
            if not self.chunks[chunk_index].persistent:
                param.data = param.data.clone()
                self._privatized.add(chunk_index)

    def _backward_done(self, chunk_index: int) -> bool:
        return self.chunks[chunk_index].info.trainable and self._remaining[chunk_index] == 0

    # ------------------------------------------------------------------ gradient reduction

    def reset_backward(self) -> None:
        self._pinned = set()
        self._fired.zero_()
        self._next_reduction = 0
        for chunk in self.chunks:
            self._remaining[chunk.index] = sum(1 for i in chunk.info.params if self.params[i].requires_grad)

    def _issue_ready_reductions(self) -> None:
        while self._next_reduction < len(self._reduce_order):
            chunk_index = self._reduce_order[self._next_reduction]
            if self._remaining[chunk_index] > 0:
                return
            self._reduce(chunk_index)
            self._next_reduction += 1

    def finish_backward(self) -> None:
        """Flush chunks that unused parameters left incomplete, in the fixed order, and wait for
        every reduction to land in the shards."""
        try:
            while self._next_reduction < len(self._reduce_order):
                self._reduce(self._reduce_order[self._next_reduction])
                self._next_reduction += 1
            self.drain()
        finally:
            # Also after a failure: the next backward must not find this one's buffers or count.
            self._grad_buffers.clear()
            self._grad_pool.release()
            self._speculation_lr = None  # queued updates finish on their own; step() waits for them
            self.reset_backward()

    def _reduce(self, chunk_index: int) -> None:
        """Queue the chunk's reduce-scatter (and the fp32 accumulation into its shard) on the
        side stream; backward goes on meanwhile."""
        chunk = self.chunks[chunk_index]
        grad_shard = chunk.grad_shard
        assert grad_shard is not None
        buffer = self._grad_buffers.pop(chunk_index, None)
        if self._direct_grads(chunk):
            reduced = DeviceEvent.completed()  # the gradients are in the shard already
        elif buffer is None and self.dist_ctx.world_size == 1:
            reduced = DeviceEvent.completed()  # no gradient, nothing to add
        else:
            if buffer is None:  # no gradient here; other ranks may have some, so take part anyway
                buffer = self._grad_pool.take()
            reduced = self._submit(lambda: self._reduce_into(buffer, grad_shard))
            self._grad_pool.reducing(buffer, reduced)
        if self._speculation_lr is not None and not chunk.persistent:
            active = [bool(self._fired_in_window[s.param]) for s in chunk.segments]
            lr = self._speculation_lr
            self._last_adam = self._cpu_adam.submit(lambda: self._speculate(chunk, reduced, active, lr))

    @torch.no_grad()
    def _reduce_into(self, buffer: torch.Tensor, grad_shard: torch.Tensor) -> None:
        if buffer.is_cuda:
            # Allocated on the compute stream, used here on the side stream: keep the caching
            # allocator from handing it out again before this work is done.
            buffer.record_stream(torch.cuda.current_stream(buffer.device))
        world = self.dist_ctx.world_size
        if world == 1:
            grad_shard.add_(buffer.to(grad_shard.device, torch.float32))
            return
        reduced = reduce_scatter_flat_(buffer, self.dist_ctx.group).div_(world)
        grad_shard.add_(reduced.to(grad_shard.device, torch.float32))

    def _submit(self, work: Callable[[], None]) -> DeviceEvent:
        self._last_submitted = self.stream.submit(work)
        return self._last_submitted

    def drain(self) -> None:
        """Wait for everything queued on the side stream (it runs in order, so the last event
        suffices). Collectives from the main thread may only follow a drain: every rank must
        issue its collectives in one order."""
        if self._last_submitted is not None:
            self._last_submitted.wait()
            self._last_submitted = None

    # ------------------------------------------------------------------ speculative CPU Adam

    def begin_last_backward(self, *, lr: float, local_nonfinite: bool) -> None:
        """The coming backward ends the accumulation window: update offloaded chunks as their
        gradients arrive, overlapping the rest of backward (the engine calls this).

        A non-finite loss on any rank skips the step, so the ranks first agree (one tiny
        all-reduce, queued on the side stream ahead of the reductions) whether any had one; if so
        nothing is updated early. The other undo, a triggering clip, needs a snapshot of what
        each early update changes, kept when ``undo_snapshots`` says so (clipping is on).
        Without it an early update is final; a parameter that had no gradient here but had one
        on another rank is simply updated at the step (segments are updated independently)."""
        if not (
            self.speculative_cpu_adam and any(not c.persistent and c.info.trainable for c in self.chunks)
        ):
            return
        flag = torch.tensor([1.0 if local_nonfinite else 0.0], dtype=torch.float64)
        agreed = self._submit(lambda: all_reduce_sum_(flag, self.dist_ctx))
        self._speculation_lr = lr
        self._speculation_allowed = (agreed, flag)

    def _speculate(self, chunk: Chunk, reduced: DeviceEvent, active: list[bool], lr: float) -> None:
        """On the CPU-Adam thread: wait for the chunk's reduced gradient, keep a snapshot of what
        the update changes when it may have to be undone, update. One thread, so it does not
        take the cores backward uses."""
        torch.set_num_threads(1)
        assert self._speculation_allowed is not None
        agreed, any_nonfinite = self._speculation_allowed
        agreed.wait()
        if float(any_nonfinite) > 0:
            return  # the step will be skipped on every rank
        reduced.wait()
        assert chunk.optimizer is not None and chunk.grad_shard is not None and chunk.master is not None
        optimizer = chunk.optimizer
        if self.undo_snapshots:
            if chunk.snapshot is None:
                chunk.snapshot = tuple(
                    self._host_like(t) for t in (chunk.master, optimizer.exp_avg, optimizer.exp_avg_sq)
                )
                chunk.snapshot += (optimizer.steps.clone(),)
            for saved, live in zip(
                chunk.snapshot,
                (chunk.master, optimizer.exp_avg, optimizer.exp_avg_sq, optimizer.steps),
                strict=True,
            ):
                saved.copy_(live)
        optimizer.step_(chunk.grad_shard, active, lr=lr)
        chunk.speculated_active = active
        chunk.speculation_undoable = self.undo_snapshots
        self.num_speculations += 1

    def _host_like(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.host_arena is None:
            return torch.empty_like(tensor)
        return self.host_arena.allocate(tensor.numel(), tensor.dtype)

    def finish_speculation(self) -> None:
        """Wait for the CPU-Adam thread; no more speculation in this window."""
        self._speculation_lr = None
        if self._last_adam is not None:
            self._last_adam.wait()
            self._last_adam = None

    def speculation_undoable(self) -> bool:
        """Whether every early update of this window can still be undone (none was made, or each
        kept its snapshot)."""
        return all(c.speculated_active is None or c.speculation_undoable for c in self.trainable_chunks())

    def discard_speculation(self) -> None:
        """Undo every speculative update of this window (the step is skipped or clipped)."""
        self.finish_speculation()
        for chunk in self.trainable_chunks():
            self._restore(chunk)

    def _restore(self, chunk: Chunk) -> None:
        if chunk.speculated_active is None:
            return
        if not chunk.speculation_undoable:
            raise RuntimeError(
                f"chunk {chunk.info.index} was updated early without a snapshot and cannot be undone "
                "(early updates keep one only when gradient clipping is on)"
            )
        assert chunk.snapshot is not None and chunk.optimizer is not None and chunk.master is not None
        optimizer = chunk.optimizer
        for saved, live in zip(
            chunk.snapshot,
            (chunk.master, optimizer.exp_avg, optimizer.exp_avg_sq, optimizer.steps),
            strict=True,
        ):
            live.copy_(saved)
        chunk.speculated_active = None
        self.num_restores += 1

    # ------------------------------------------------------------------ the update

    def params_with_grad(self) -> torch.Tensor:
        """Per parameter, whether any micro-batch of this window produced a gradient here."""
        return self._fired_in_window.to(torch.float64)

    def grad_norm(self) -> float:
        self.drain()
        squares = torch.zeros((), dtype=torch.float64)
        for chunk in self.trainable_chunks():
            assert chunk.grad_shard is not None
            # One fp32 pass per shard (as clip_grad_norm_ takes per-tensor norms); the sum of
            # squares across shards and ranks in float64.
            squares += torch.linalg.vector_norm(chunk.grad_shard).double().cpu().square()
        all_reduce_sum_(squares, self.dist_ctx)
        return math.sqrt(float(squares))

    def scale_grads_(self, factor: float) -> None:
        for chunk in self.trainable_chunks():
            assert chunk.grad_shard is not None
            chunk.grad_shard.mul_(factor)

    def step(self, *, lr: float, active: torch.Tensor) -> None:
        """AdamW on every trainable shard (``active``: per parameter, whether any rank produced a
        gradient this window), then refresh the device copies. A chunk already updated
        speculatively with the same activity is left as it is; otherwise it is restored and
        updated here."""
        self.finish_speculation()
        for chunk in self.trainable_chunks():
            assert chunk.optimizer is not None and chunk.grad_shard is not None
            wanted = [bool(active[s.param]) for s in chunk.segments]
            speculated = chunk.speculated_active
            chunk.speculated_active = None
            if speculated is not None:
                # Only another rank's gradient can make a segment active that was not active
                # here; such a segment was left untouched early, so update just those now.
                wanted = [want and not done for want, done in zip(wanted, speculated, strict=True)]
                if not any(wanted):
                    continue
            chunk.optimizer.step_(chunk.grad_shard, wanted, lr=lr)
        self.refresh_full_copies()

    def zero_grad(self) -> None:
        for chunk in self.trainable_chunks():
            assert chunk.grad_shard is not None
            chunk.grad_shard.zero_()
        self._fired_in_window.zero_()

    @torch.no_grad()
    def refresh_full_copies(self, *, frozen_too: bool = False) -> None:
        """After an update: re-gather persistent chunks; drop every buffered copy of the others
        (including prefetches that arrived with pre-update data). ``frozen_too``: also the
        persistent chunks of frozen parameters (after a checkpoint load changed them)."""
        self.drain()
        for chunk in self.chunks:
            if chunk.persistent and (chunk.info.trainable or frozen_too):
                assert chunk.full is not None
                if chunk.master is not chunk.full:
                    self._gather(chunk, chunk.full)
            elif chunk.residency is Residency.FETCHING:
                self.ensure_resident(chunk.index)
                self.evict(chunk.index)
            elif chunk.residency is Residency.RESIDENT:
                self.evict(chunk.index)

    def trainable_chunks(self) -> Iterator[Chunk]:
        return (chunk for chunk in self.chunks if chunk.info.trainable)

    # ------------------------------------------------------------------ reading the model

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter in full precision by its own names (tied ones under each name)."""
        self.drain()
        result: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            assert chunk.master is not None
            shard = chunk.master.to(self.device.device)
            if self.dist_ctx.world_size == 1:
                full = shard.clone()
            else:
                full = torch.empty(self.layout.chunk_numel, dtype=shard.dtype, device=self.device.device)
                all_gather_flat(full, shard, self.dist_ctx.group)
            for index in chunk.info.params:
                info = self.layout.params[index]
                offset = self.layout.slots[index].offset
                value = full[offset : offset + info.numel].view(info.shape).clone()
                for name in (info.name, *info.aliases):
                    result[name] = value
        return result

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.stream.close()
        self._cpu_adam.close()
