"""Chunk storage on one rank: flat ZeRO-3 shards, persistent full copies, the host arena.

Each chunk of the layout is one flat buffer of ``chunk_numel`` elements, split evenly over the
ranks. This rank keeps its shard in fp32 (master weights, gradient) with the optimizer state:
on the device for the first ``n_persist`` chunks, in host memory for the others (an mmap arena,
pinned on CUDA). A host shard holds only the rank's real elements (parameters are packed from
offset 0, so they are a prefix of its shard): chunk padding exists in device buffers and
collectives alone, and the arena is sized to the byte by profiler/host_bytes.py, which the cost
model counts with. An offloaded chunk keeps no gradient shard when each reduced gradient is
applied as it arrives (``keeps_gradients`` False: no clipping, no fp16, no accumulation): 12
bytes per parameter on the host instead of 16. Compute uses a full, all-gathered copy in the
compute dtype: persistent chunks own one for the whole run; the others borrow a device buffer
slot while they are needed (residency.py decides when).

What a chunk holds depends on what it is, and exists by construction rather than as nullable
fields: every chunk has its info, its segments and its master shard; a ``PersistentChunk`` has its
full copy; an ``OffloadedChunk`` holds a slot (and the full copy in it) only while it is fetching
or resident; a trainable chunk has ``ShardTraining`` (AdamW over the master, and a gradient
shard unless it is offloaded with gradients applied as they arrive), a frozen one none. What
the optimizer keeps per chunk for one window (early updates) lives in the optimizer's own side
tables (optimizer.py), never on the chunk.

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

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from protrain.runtime.chunks.layout import ChunkInfo, ChunkLayout
from protrain.runtime.chunks.nvme_state import NvmeStateTier
from protrain.runtime.chunks.released import mark_released, mark_resident
from protrain.runtime.chunks.residency_states import Residency, check_move
from protrain.runtime.chunks.tiers import StateTiers
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.distributed import DistContext
from protrain.runtime.optim.shard import ShardOptimizer


@dataclass(frozen=True, slots=True)
class Segment:
    """The part of one parameter that lies in this rank's shard of a chunk."""

    param: int
    shard_offset: int
    param_offset: int
    numel: int


def shard_segments(layout: ChunkLayout, chunk: ChunkInfo, rank: int) -> list[Segment]:
    shard = layout.shard_numel
    return range_segments(layout, chunk, rank * shard, (rank + 1) * shard)


def range_segments(layout: ChunkLayout, chunk: ChunkInfo, lo: int, hi: int) -> list[Segment]:
    """The parts of the chunk's parameters in its elements [lo, hi): a rank's shard, or the whole
    chunk (a replicated one)."""
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
    """What only a trainable chunk has: its fp32 gradient shard and the optimizer rule's kernel
    over its master (runtime/optim/)."""

    grad_shard: torch.Tensor | None
    """None for an offloaded chunk whose gradients are applied as they arrive (no shard kept)."""
    optimizer: ShardOptimizer
    nvme: NvmeStateTier | None = None
    """The tier holding the optimizer state in a file (the kernel's tensors are a slot's)."""
    master_on_nvme: bool = False
    """The fp32 master is in the file too (a 16-bit compute dtype): the chunk's ``master`` is its
    compute copy, which each update refreshes (nvme_state.py)."""
    grad_in_file: bool = False
    """The kept gradient is in a file of the tier (``grad_shard`` None; nvme_grads.py)."""


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
    def is_replicated(self) -> bool:
        """Every rank holds the whole chunk's state (a replicated persistent chunk)."""
        return isinstance(self, PersistentChunk) and self.replicated

    def share_start(self, shard_numel: int, rank: int) -> int:
        """Where this rank's stored elements start in the chunk: its shard's start, or 0 for a
        replicated chunk, which stores the whole chunk."""
        return 0 if self.is_replicated else rank * shard_numel

    @property
    def full(self) -> torch.Tensor | None:
        """The full compute copy while there is one on the device."""
        raise NotImplementedError

    @property
    def grad_shard(self) -> torch.Tensor:
        grad_shard = self._training().grad_shard
        if grad_shard is None:
            in_file = self._training().grad_in_file
            where = "keeps its gradient in a file" if in_file else "applies each gradient as it arrives"
            raise RuntimeError(f"chunk {self.index} {where}: it keeps no gradient shard")
        return grad_shard

    @property
    def keeps_gradient(self) -> bool:
        """A trainable chunk with a gradient shard (every persistent one; offloaded ones when
        gradients must be kept across micro-batches or until the norm is known; an NVMe chunk's
        is in a file)."""
        training = self.training
        return training is not None and (training.grad_shard is not None or training.grad_in_file)

    @property
    def numel(self) -> int:
        """Elements of this rank's shard it stores: the real ones of an offloaded chunk (a
        prefix of the shard), the whole shard of a persistent one."""
        return self.master.numel()

    @property
    def optimizer(self) -> ShardOptimizer:
        return self._training().optimizer

    def _training(self) -> ShardTraining:
        if self.training is None:
            raise RuntimeError(f"chunk {self.index} holds frozen parameters: no gradient or optimizer state")
        return self.training

    def state_tensors(self) -> list[torch.Tensor]:
        """What is saved and moved per chunk: the master shard, then (trainable) the optimizer
        rule's state tensors, in its ``state_names`` order."""
        if self.training is None:
            return [self.master]
        if self.training.nvme is not None:  # the file, page by page
            mapped = list(self.training.nvme.mapped(self.index))
            return mapped if self.training.master_on_nvme else [self.master, *mapped]
        return [self.master, *self.training.optimizer.states]

    @property
    def master_on_nvme(self) -> bool:
        """``master`` is a compute copy: the fp32 master is in the NVMe tier's file."""
        return self.training is not None and self.training.master_on_nvme

    def stored_master(self) -> torch.Tensor:
        """The master as stored, for reading: ``master``, or the file's fp32 one (mapped)."""
        return self.state_tensors()[0] if self.master_on_nvme else self.master

    def refresh_copy(self) -> None:
        """After the file's master was written (a checkpoint load, a plan switch): the compute
        copy follows it."""
        if self.master_on_nvme:
            self.master.copy_(self.state_tensors()[0])

    @property
    def state_on_nvme(self) -> bool:
        """The optimizer state is in a file, updated in a host slot (nvme_state.py)."""
        return self.training is not None and self.training.nvme is not None

    def move(self, target: Residency) -> None:
        self.residency = check_move(self.index, self.residency, target)


@dataclass(eq=False, slots=True)
class PersistentChunk(Chunk):
    """A chunk that stays on the device: its full copy exists for the whole run. A replicated
    one holds the whole chunk's state on every rank (master, gradient, optimizer state: its
    "shard" is the chunk), all-reduces its gradients and refreshes its full copy from its own
    master, as DDP does; the others hold this rank's shard (ZeRO-3)."""

    device_full: torch.Tensor = field(kw_only=True)
    replicated: bool = field(default=False, kw_only=True)

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
        tiers: StateTiers,
        compute_dtype: torch.dtype,
        device: DeviceInfo,
        dist_ctx: DistContext,
    ) -> None:
        self.layout = layout
        self.params = params
        self.chunks = chunks
        self.tiers = tiers
        self.host_arena = tiers.host.arena
        """The offloaded chunks' host region (None: none is offloaded)."""
        self.compute_dtype = compute_dtype
        self.device = device
        self.dist_ctx = dist_ctx
        self.chunk_of_param = [slot.chunk for slot in layout.slots]
        self._index_of = {id(p): i for i, p in enumerate(params)}
        self._nan: torch.Tensor | None = None

    def chunk_of(self, param: nn.Parameter) -> int:
        return self.chunk_of_param[self._index_of[id(param)]]

    def manages(self, param: torch.Tensor) -> bool:
        index = self._index_of.get(id(param))
        return index is not None and self.params[index] is param

    def param_index(self, param: nn.Parameter) -> int:
        return self._index_of[id(param)]

    def trainable_chunks(self) -> Iterator[Chunk]:
        return (chunk for chunk in self.chunks if chunk.training is not None)

    def view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s place in a flat tensor laid out like its chunk."""
        param = self.params[index]
        offset = self.layout.slots[index].offset
        return flat[offset : offset + param.numel()].view(param.shape)

    # ------------------------------------------------------------------ where parameters point

    def point_params(self, chunk: Chunk) -> None:
        """Parameters view the chunk's full copy, or the NaN placeholder when it has none (a
        read of one is refused then: released.py)."""
        full = chunk.full
        for index in chunk.info.params:
            param = self.params[index]
            if full is None:
                param.data = self._placeholder(param)
                mark_released(param, self.layout.params[index].name)
            else:
                param.data = self.view(full, index)
                mark_resident(param)

    def _placeholder(self, param: nn.Parameter) -> torch.Tensor:
        if self._nan is None:
            self._nan = torch.full((1,), float("nan"), dtype=self.compute_dtype, device=self.device.device)
        return self._nan.expand(param.shape) if param.dim() else self._nan[0]

    def direct_grads(self, chunk: Chunk) -> bool:
        """fp32 compute, the shard's gradient on the compute device, and the whole chunk's on
        this rank (one rank, or a replicated chunk): gradients accumulate straight into the fp32
        shard, as DDP's ``gradient_as_bucket_view`` has them accumulate into its buckets. With
        several ranks the shard is then all-reduced in place once per window (reduce.py)."""
        return (
            (self.dist_ctx.world_size == 1 or chunk.is_replicated)
            and self.compute_dtype == torch.float32
            and chunk.training is not None
            and chunk.training.grad_shard is not None
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
        return self.tiers.host.empty_like(tensor)

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
                tensors += [chunk.training.grad_shard, *chunk.training.optimizer.states]
        for tensor in tensors:
            if tensor is None or self.tiers.on_host(tensor):
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    def on_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is chunk state in host memory (not on the compute device)."""
        return self.tiers.on_host(tensor)

    def release_device(self) -> None:
        """Let go of every chunk and of what the parameters point at: each parameter views the
        placeholder and has no gradient (the store is done with: a plan switch built another)."""
        for index, param in enumerate(self.params):
            param.data = self._placeholder(param)
            param.grad = None
            mark_released(param, self.layout.params[index].name, closed=True)
        self.chunks.clear()
        if self.tiers.nvme is not None:
            self.tiers.nvme.close()  # views a plan switch took of its files stay readable


def padded_shard(stored: torch.Tensor, shard_numel: int, device: torch.device) -> torch.Tensor:
    """A stored shard on ``device`` at the collectives' shard size (zeros past its real
    elements): what an all-gather of whole chunks takes from this rank."""
    if stored.numel() == shard_numel:
        return stored.to(device)
    out = torch.zeros(shard_numel, dtype=stored.dtype, device=device)
    out[: stored.numel()].copy_(stored)
    return out
