"""Chunk storage on one rank: flat ZeRO-3 shards, persistent full copies, the host arena.

Each chunk of the layout is one flat buffer of ``chunk_numel`` elements, split evenly over the
ranks. This rank keeps its shard in fp32 (master weights, gradient) with the optimizer state:
on the device for the first ``n_persist`` chunks, in host memory for the others (an mmap arena,
pinned on CUDA, at exact sizes). Compute uses a full, all-gathered copy in the compute dtype:
persistent chunks own one for the whole run; the others borrow a device buffer slot while they
are needed (residency.py decides when).

What a chunk holds depends on what it is, and exists by construction rather than as nullable
fields: every chunk has its info, its segments and its master shard; a ``PersistentChunk`` has its
full copy; an ``OffloadedChunk`` holds a slot (and the full copy in it) only while it is fetching
or resident; a trainable chunk has ``ShardTraining`` (gradient shard, AdamW over the master), a
frozen one none. What the optimizer keeps per chunk for one window (early
updates) lives in the optimizer's own side tables (optimizer.py), never on the chunk.

Parameters are ordinary ``nn.Parameter`` objects whose ``.data`` points into the chunk's full
copy while it is resident. When a chunk leaves its slot, its parameters point at a zero-byte
placeholder of the right shape filled with NaN (a stride-0 expansion of one element): autograd's
gradient accumulation needs the parameter's shape even when its data is gone, and a stray read
gives NaN, which the engine's non-finite check turns into an error.

Direct gradients: with one rank, fp32 compute and the gradient shard on the compute device there
is nothing to reduce, so each parameter's ``.grad`` is its slice of the fp32 shard and autograd
accumulates into the shard in place (no copy pass over the gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from runtime.chunks.layout import ChunkInfo, ChunkLayout
from runtime.chunks.residency import Residency, check_move
from runtime.cpu_adam import ShardAdamW
from runtime.device import DeviceInfo
from runtime.distributed import DistContext, all_gather_flat, broadcast_from_main_
from runtime.host_memory import MmapArena


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


@dataclass(eq=False, slots=True)
class ShardTraining:
    """What only a trainable chunk has: its fp32 gradient shard and AdamW over its master."""

    grad_shard: torch.Tensor
    optimizer: ShardAdamW


@dataclass(eq=False, slots=True)
class HeldSlot:
    """The device buffer slot an offloaded chunk holds while fetching or resident."""

    slot: int
    full: torch.Tensor


@dataclass(eq=False, slots=True)
class Chunk:
    """One chunk's state on this rank (see the module docstring for what each kind holds)."""

    info: ChunkInfo
    segments: list[Segment]
    master: torch.Tensor
    """fp32 shard (trainable chunks) or compute-dtype shard (frozen chunks)."""
    training: ShardTraining | None
    """None exactly for a chunk of frozen parameters."""
    residency: Residency

    @property
    def index(self) -> int:
        return self.info.index

    @property
    def persistent(self) -> bool:
        return self.residency is Residency.PERSISTENT

    @property
    def full(self) -> torch.Tensor | None:
        """The full compute copy while there is one on the device."""
        raise NotImplementedError

    @property
    def grad_shard(self) -> torch.Tensor:
        return self._training().grad_shard

    @property
    def optimizer(self) -> ShardAdamW:
        return self._training().optimizer

    def _training(self) -> ShardTraining:
        if self.training is None:
            raise RuntimeError(f"chunk {self.index} holds frozen parameters: no gradient or optimizer state")
        return self.training

    def state_tensors(self) -> list[torch.Tensor]:
        """What is saved and moved per chunk: the master shard, then (trainable) the two moments."""
        if self.training is None:
            return [self.master]
        return [self.master, self.training.optimizer.exp_avg, self.training.optimizer.exp_avg_sq]

    def move(self, target: Residency) -> None:
        self.residency = check_move(self.index, self.residency, target)


@dataclass(eq=False, slots=True)
class PersistentChunk(Chunk):
    """A chunk that stays on the device: its full copy exists for the whole run."""

    device_full: torch.Tensor = field(kw_only=True)

    @property
    def full(self) -> torch.Tensor:
        return self.device_full


@dataclass(eq=False, slots=True)
class OffloadedChunk(Chunk):
    """A chunk whose shard lives in host memory and passes through a device buffer slot."""

    held: HeldSlot | None = None
    """Present exactly while the chunk is FETCHING or RESIDENT."""

    @property
    def full(self) -> torch.Tensor | None:
        return None if self.held is None else self.held.full

    def hold(self, slot: int, full: torch.Tensor) -> None:
        """HOST -> FETCHING into ``slot`` (its tensor ``full``)."""
        self.move(Residency.FETCHING)
        self.held = HeldSlot(slot=slot, full=full)

    def release(self) -> int:
        """RESIDENT -> HOST; the slot given up."""
        self.move(Residency.HOST)
        assert self.held is not None
        slot, self.held = self.held.slot, None
        return slot


class ChunkStore:
    """Every chunk's storage on this rank and the maps between parameters and chunks (side
    tables keyed by parameter index: nothing is hung on the ``Parameter`` objects)."""

    def __init__(
        self,
        *,
        layout: ChunkLayout,
        params: list[nn.Parameter],
        chunks: list[Chunk],
        host_arena: MmapArena | None,
        compute_dtype: torch.dtype,
        device: DeviceInfo,
        dist_ctx: DistContext,
    ) -> None:
        self.layout = layout
        self.params = params
        self.chunks = chunks
        self.host_arena = host_arena
        self.compute_dtype = compute_dtype
        self.device = device
        self.dist_ctx = dist_ctx
        self.chunk_of_param = [slot.chunk for slot in layout.slots]
        self._index_of = {id(p): i for i, p in enumerate(params)}
        self._nan: torch.Tensor | None = None

    def chunk_of(self, param: nn.Parameter) -> int:
        return self.chunk_of_param[self._index_of[id(param)]]

    def trainable_chunks(self) -> Iterator[Chunk]:
        return (chunk for chunk in self.chunks if chunk.training is not None)

    def view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s place in a flat tensor laid out like its chunk."""
        param = self.params[index]
        offset = self.layout.slots[index].offset
        return flat[offset : offset + param.numel()].view(param.shape)

    # ------------------------------------------------------------------ where parameters point

    def point_params(self, chunk: Chunk) -> None:
        """Parameters view the chunk's full copy, or the NaN placeholder when it has none."""
        full = chunk.full
        for index in chunk.info.params:
            param = self.params[index]
            param.data = self._placeholder(param) if full is None else self.view(full, index)

    def _placeholder(self, param: nn.Parameter) -> torch.Tensor:
        if self._nan is None:
            self._nan = torch.full((1,), float("nan"), dtype=self.compute_dtype, device=self.device.device)
        return self._nan.expand(param.shape) if param.dim() else self._nan[0]

    def direct_grads(self, chunk: Chunk) -> bool:
        """One rank, fp32 compute, shard gradient on the compute device: there is nothing to
        reduce, so gradients accumulate straight into the fp32 shard."""
        return (
            self.dist_ctx.world_size == 1
            and self.compute_dtype == torch.float32
            and chunk.training is not None
            and chunk.training.grad_shard.device == self.device.device
        )

    def point_grads(self, chunk: Chunk) -> None:
        """Direct-gradient chunks: each parameter's ``.grad`` is its slice of the fp32 shard, so
        autograd accumulates into the shard in place (no copy pass over the gradients)."""
        if not self.direct_grads(chunk):
            return
        for index in chunk.info.params:
            param = self.params[index]
            if param.requires_grad:
                param.grad = self.view(chunk.grad_shard, index)

    # ------------------------------------------------------------------ memory accounting

    def host_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """An empty host tensor like ``tensor``, from the arena when there is one."""
        if self.host_arena is None:
            return torch.empty_like(tensor)
        return self.host_arena.allocate(tensor.numel(), tensor.dtype)

    def state_storages(self) -> set[int]:
        """Storage addresses of persistent copies and shards (the slots are residency's)."""
        storages: set[int] = set()
        for chunk in self.chunks:
            tensors = [chunk.full if chunk.persistent else None, chunk.master]
            tensors.append(None if chunk.training is None else chunk.training.grad_shard)
            for tensor in tensors:
                if tensor is not None:
                    storages.add(tensor.untyped_storage().data_ptr())
        return storages

    def device_state_bytes(self, slots: Sequence[torch.Tensor]) -> int:
        """Bytes of chunk state on the compute device (persistent copies and their fp32 state,
        the buffer ``slots``), each storage once: the static part of the device peak."""
        seen: set[int] = set()
        total = 0
        tensors: list[torch.Tensor | None] = list(slots)
        for chunk in self.chunks:
            tensors += [chunk.full, chunk.master]
            if chunk.training is not None:
                optimizer = chunk.training.optimizer
                tensors += [chunk.training.grad_shard, optimizer.exp_avg, optimizer.exp_avg_sq]
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

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter in full precision by its own names (tied ones under each name). The
        caller has drained the collective queue: the all-gathers here come from the main thread."""
        result: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
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


@dataclass(frozen=True, slots=True)
class AdamWHyper:
    """The optimizer settings each trainable chunk's ``ShardAdamW`` is built with."""

    weight_decay: Sequence[float]
    """Per parameter (by layout index)."""
    group: Sequence[int]
    """Per parameter (by layout index): its parameter group (runtime/param_groups.py)."""
    lrs: Sequence[float]
    """Per parameter group, the peak learning rate."""
    betas: Sequence[tuple[float, float]]
    """Per parameter group."""
    eps: float


def build_store(
    *,
    params: list[nn.Parameter],
    layout: ChunkLayout,
    n_persist: int,
    compute_dtype: torch.dtype,
    device: DeviceInfo,
    dist_ctx: DistContext,
    adamw: AdamWHyper,
    read_param: Callable[[str], torch.Tensor] | None,
) -> ChunkStore:
    """Copy each parameter into its chunk; keep this rank's shard; give up the originals (the
    parameters then view their chunk's full copy, or the placeholder)."""
    num_offloaded = sum(1 for info in layout.chunks if info.index >= n_persist)
    builder = _ChunkBuilder(
        params=params,
        layout=layout,
        compute_dtype=compute_dtype,
        device=device,
        dist_ctx=dist_ctx,
        adamw=adamw,
        host_arena=_build_host_arena(layout, num_offloaded, device=device),
        read_param=read_param,
    )
    chunks = [builder.build(info, persistent=info.index < n_persist) for info in layout.chunks]
    store = ChunkStore(
        layout=layout,
        params=params,
        chunks=chunks,
        host_arena=builder.host_arena,
        compute_dtype=compute_dtype,
        device=device,
        dist_ctx=dist_ctx,
    )
    for chunk in chunks:
        store.point_params(chunk)
        store.point_grads(chunk)
    return store


def _build_host_arena(layout: ChunkLayout, num_offloaded: int, *, device: DeviceInfo) -> MmapArena | None:
    if not num_offloaded:
        return None
    # fp32 master, gradient and two Adam moments per offloaded chunk's shard, each rounded up to
    # a page (frozen chunks need less; unused arena is only address space, but pinned on CUDA).
    shard_bytes = layout.shard_numel * 4 + 4096
    return MmapArena(num_offloaded * 4 * shard_bytes, pin=device.is_cuda)


@dataclass(eq=False)
class _ChunkBuilder:
    params: list[nn.Parameter]
    layout: ChunkLayout
    compute_dtype: torch.dtype
    device: DeviceInfo
    dist_ctx: DistContext
    adamw: AdamWHyper
    host_arena: MmapArena | None
    read_param: Callable[[str], torch.Tensor] | None

    def build(self, info: ChunkInfo, *, persistent: bool) -> Chunk:
        rank, shard = self.dist_ctx.rank, self.layout.shard_numel
        flat = self._flat(info)
        if self.read_param is None:
            # A model held whole was built by each rank on its own: rank 0's values, one chunk
            # at a time (never the whole model on the device). Read values are the same file
            # everywhere.
            broadcast_from_main_([flat], self.dist_ctx)
        mine = flat[rank * shard : (rank + 1) * shard]
        segments = shard_segments(self.layout, info, rank)
        full = flat.to(device=self.device.device, dtype=self.compute_dtype) if persistent else None
        training = None
        if not info.trainable:
            master = self._place(mine.to(self.compute_dtype), persistent)
        else:
            if full is not None and self.dist_ctx.world_size == 1 and self.compute_dtype == torch.float32:
                # One rank, fp32 compute: the full copy already is the fp32 shard; keep one.
                master = full
            else:
                master = self._place(mine, persistent)
            training = self._training(master, segments, persistent)
        if full is not None:
            return PersistentChunk(
                info, segments, master, training, Residency.PERSISTENT, device_full=full
            )
        return OffloadedChunk(info, segments, master, training, Residency.HOST)

    def _flat(self, info: ChunkInfo) -> torch.Tensor:
        """The whole chunk in fp32 in host memory, from the parameters (wherever they are: a
        model held in host memory is read there, so only its chunks reach the device) or
        ``read_param``."""
        flat = torch.zeros(self.layout.chunk_numel, dtype=torch.float32)
        for index in info.params:
            offset = self.layout.slots[index].offset
            param = self.params[index]
            if self.read_param is not None:
                value = self.read_param(self.layout.params[index].name)
            else:
                value = param.detach()
            flat[offset : offset + param.numel()].copy_(value.reshape(-1))
            del value  # a streamed value lives only until it is in its chunk
        return flat

    def _training(self, master: torch.Tensor, segments: list[Segment], persistent: bool) -> ShardTraining:
        shard = self.layout.shard_numel
        grad_shard = self._place(torch.zeros(shard), persistent)
        moments = (
            self._place(torch.zeros(shard), persistent),
            self._place(torch.zeros(shard), persistent),
        )
        optimizer = ShardAdamW(
            master,
            [
                (s.shard_offset, s.numel, self.adamw.weight_decay[s.param], self.adamw.group[s.param])
                for s in segments
            ],
            lr=self.adamw.lrs,
            betas=self.adamw.betas,
            eps=self.adamw.eps,
            moments=moments,
        )
        return ShardTraining(grad_shard=grad_shard, optimizer=optimizer)

    def _place(self, tensor: torch.Tensor, persistent: bool) -> torch.Tensor:
        if persistent or self.host_arena is None:
            # One copy on the device (``to`` then ``clone`` would briefly hold two).
            return tensor.to(self.device.device, copy=True) if persistent else tensor.clone()
        out = self.host_arena.allocate(tensor.numel(), tensor.dtype)
        out.copy_(tensor)
        return out
