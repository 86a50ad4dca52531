"""Building a rank's chunk store: each parameter copied into its chunk, this rank's shard kept
(on the device for persistent chunks, in the host arena at exact sizes for the others), the
originals given up. Split from store.py, which holds what the store is once built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from protrain.profiler.chunking import persistent_full_numel
from protrain.profiler.host_bytes import HOST_ALIGN_BYTES, chunk_state_bytes, nvme_positions, nvme_tensors, rank_numel
from protrain.runtime.chunks.layout import ChunkInfo, ChunkLayout
from protrain.runtime.chunks.nvme_state import NvmeStateTier
from protrain.runtime.chunks.residency_states import Residency
from protrain.runtime.chunks.store import (
    Chunk,
    ChunkStore,
    OffloadedChunk,
    PersistentChunk,
    Segment,
    ShardTraining,
    range_segments,
    shard_segments,
)
from protrain.runtime.chunks.tiers import DeviceTier, HostTier, StateTiers
from protrain.runtime.hw import device_wall
from protrain.runtime.hw.device import DeviceInfo, trim_host_heap
from protrain.runtime.hw.distributed import DistContext, broadcast_from_main_
from protrain.runtime.hw.host_memory import MmapArena
from protrain.runtime.optim.rule import OptimizerHyper, OptimizerRule


def build_store(
    *,
    params: list[nn.Parameter],
    layout: ChunkLayout,
    n_persist: int,
    compute_dtype: torch.dtype,
    device: DeviceInfo,
    dist_ctx: DistContext,
    optimizer: OptimizerRule,
    hyper: OptimizerHyper,
    read_param: Callable[[str], torch.Tensor] | None,
    keeps_gradients: bool = True,
    n_replicate: int = 0,
    n_optimizer: int = 0,
    nvme_root: Path | None = None,
    nvme_beside: tuple[int, str] = (0, ""),
) -> ChunkStore:
    """Copy each parameter into its chunk; keep this rank's shard (the whole chunk for the first
    ``n_replicate`` chunks, replicated: at most ``n_persist``); give up the originals (the
    parameters then view their chunk's full copy, or the placeholder). ``keeps_gradients``
    False: offloaded chunks get no gradient shard (their gradients are applied as they arrive).
    ``n_optimizer``: the last offloaded trainable chunks keep their optimizer state in files under
    ``nvme_root`` (nvme_state.py), whose disk must hold ``nvme_beside`` too (bytes, in words)."""
    if n_replicate > n_persist:
        raise ValueError(f"n_replicate={n_replicate} exceeds n_persist={n_persist}: only persistent chunks replicate")
    element_size = torch.empty((), dtype=compute_dtype).element_size()
    nvme = _build_nvme_tier(
        layout,
        n_persist,
        n_optimizer,
        nvme_root,
        rank=dist_ctx.rank,
        optimizer=optimizer,
        element_size=element_size,
        gradients=keeps_gradients,
    )
    if nvme is not None:
        nvme.check_room(*nvme_beside)
    arena = _build_host_arena(
        layout,
        n_persist,
        rank=dist_ctx.rank,
        element_size=element_size,
        keeps_gradients=keeps_gradients,
        optimizer_states=len(optimizer.state_names),
        pin=device.is_cuda,
        on_nvme=set() if nvme is None else set(nvme.chunk_indices),
    )
    builder = _ChunkBuilder(
        params=params,
        layout=layout,
        compute_dtype=compute_dtype,
        device=device,
        dist_ctx=dist_ctx,
        optimizer=optimizer,
        hyper=hyper,
        tiers=StateTiers(device=DeviceTier(device), host=HostTier(arena), nvme=nvme),
        read_param=read_param,
        keeps_gradients=keeps_gradients,
    )
    chunks = []
    for info in layout.chunks:
        chunks.append(builder.build(info, persistent=info.index < n_persist, replicated=info.index < n_replicate))
        # Each chunk's originals go as soon as it holds them: the model and its chunks never
        # coexist whole in host memory (+1 copy of the model at setup before).
        _give_up_originals([params[index] for index in info.params])
        trim_host_heap()  # the originals' pages, which the arena (an mmap) cannot reuse
    store = ChunkStore(
        layout=layout,
        params=params,
        chunks=chunks,
        tiers=builder.tiers,
        compute_dtype=compute_dtype,
        device=device,
        dist_ctx=dist_ctx,
    )
    for chunk in chunks:
        store.point_params(chunk)
        store.point_grads(chunk)
    return store


def _give_up_originals(params: Sequence[nn.Parameter]) -> None:
    """Let each parameter's original storage go: until ``point_params`` points it at its chunk,
    it is a zero-stride placeholder of its shape (no memory; a model used now computes garbage,
    but nothing runs it during the build)."""
    for param in params:
        empty = torch.empty((), dtype=param.dtype, device=param.device)
        param.data = empty.expand(param.shape) if param.dim() else empty


def _build_nvme_tier(
    layout: ChunkLayout,
    n_persist: int,
    n_optimizer: int,
    root: Path | None,
    *,
    rank: int,
    optimizer: OptimizerRule,
    element_size: int,
    gradients: bool,
) -> NvmeStateTier | None:
    """The files of the last ``n_optimizer`` offloaded trainable chunks (profiler/host_bytes.py's
    ``nvme_positions``; with their gradients when kept), or None."""
    if n_optimizer <= 0:
        return None
    offloaded = [info for info in layout.chunks if info.index >= n_persist]
    on_nvme = nvme_positions([info.trainable for info in offloaded], n_optimizer)
    if len(on_nvme) < n_optimizer:
        raise ValueError(
            f"memory.ssd.n_optimizer={n_optimizer} but only {len(on_nvme)} offloaded chunks hold trainable "
            "parameters: lower n_optimizer or n_persist"
        )
    if root is None:
        raise ValueError(f"memory.ssd.n_optimizer={n_optimizer} needs memory.ssd.path (a directory)")
    tensors = nvme_tensors(len(optimizer.state_names), element_size)
    if not tensors:
        raise ValueError(
            f"memory.ssd.n_optimizer={n_optimizer}: the {optimizer.name} optimizer as configured keeps no state "
            "per parameter, so there is nothing to put on NVMe; set n_optimizer to 0"
        )
    chunks = [
        (offloaded[position].index, rank_numel(offloaded[position].used, layout.shard_numel, rank))
        for position in sorted(on_nvme)
    ]
    return NvmeStateTier(
        root=root,
        rank=rank,
        chunks=chunks,
        tensors=tensors,
        shard_numel=layout.shard_numel,
        gradients=gradients,
    )


def _build_host_arena(
    layout: ChunkLayout,
    n_persist: int,
    *,
    rank: int,
    element_size: int,
    keeps_gradients: bool,
    optimizer_states: int,
    pin: bool,
    on_nvme: set[int],
) -> MmapArena | None:
    """One region holding every offloaded chunk's host state at exact sizes
    (profiler/host_bytes.py: the cost model counts the same bytes); ``on_nvme``: chunks whose
    optimizer state is in files instead."""
    offloaded = [info for info in layout.chunks if info.index >= n_persist]
    if not offloaded:
        return None
    payload = sum(
        chunk_state_bytes(
            rank_numel(info.used, layout.shard_numel, rank),
            trainable=info.trainable,
            element_size=element_size,
            keeps_gradients=keeps_gradients,
            optimizer_states=optimizer_states,
            on_nvme=info.index in on_nvme,
        )
        for info in offloaded
    )
    return MmapArena(payload, pin=pin, alignment=HOST_ALIGN_BYTES)


@dataclass(eq=False)
class _ChunkBuilder:
    params: list[nn.Parameter]
    layout: ChunkLayout
    compute_dtype: torch.dtype
    device: DeviceInfo
    dist_ctx: DistContext
    optimizer: OptimizerRule
    hyper: OptimizerHyper
    tiers: StateTiers
    read_param: Callable[[str], torch.Tensor] | None
    keeps_gradients: bool

    def build(self, info: ChunkInfo, *, persistent: bool, replicated: bool = False) -> Chunk:
        rank, shard = self.dist_ctx.rank, self.layout.shard_numel
        flat = self._flat(info)
        if self.read_param is None:
            # A model held whole was built by each rank on its own: rank 0's values, one chunk
            # at a time (never the whole model on the device). Read values are the same file
            # everywhere.
            broadcast_from_main_([flat], self.dist_ctx)
        # Every shard holds this rank's real elements only (a prefix of its part of the chunk):
        # padding exists in the full copies and the collectives alone. A replicated chunk's
        # "shard" is the whole chunk, on every rank.
        if replicated:
            stored, start = info.used, 0
            segments = range_segments(self.layout, info, 0, self.layout.chunk_numel)
        else:
            stored, start = rank_numel(info.used, shard, rank), rank * shard
            segments = shard_segments(self.layout, info, rank)
        mine = flat[start : start + stored]
        full = None
        if persistent:
            numel = persistent_full_numel(
                info.used,
                trainable=info.trainable,
                chunk_numel=self.layout.chunk_numel,
                world_size=1 if replicated else self.dist_ctx.world_size,  # no all-gather refills it
            )
            full = torch.empty(numel, dtype=self.compute_dtype, device=self.device.device)
            full.copy_(flat[:numel])
        training = None
        if not info.trainable:
            # A frozen persistent chunk is stored once: its shard is a view of its full copy.
            master = (
                full[start : start + stored] if full is not None else self._place(mine.to(self.compute_dtype), False)
            )
        else:
            whole = self.dist_ctx.world_size == 1 or replicated
            nvme = self.tiers.nvme
            if full is not None and whole and self.compute_dtype == torch.float32:
                master = full[:stored]  # fp32 compute over the whole chunk: the full copy is the master
            elif nvme is not None and nvme.holds(info.index) and self.compute_dtype != torch.float32:
                # The fp32 master goes to its file; the host keeps the compute copy forward uploads.
                nvme.mapped(info.index)[0].copy_(mine)
                master = self._place(mine.to(self.compute_dtype), persistent)
            else:
                master = self._place(mine, persistent)
            training = self._training(master, segments, persistent, info.index)
        del flat, mine
        if full is not None:
            return PersistentChunk(
                info, segments, master, training, Residency.PERSISTENT, device_full=full, replicated=replicated
            )
        return OffloadedChunk(info, segments, master, training, Residency.HOST)

    def _flat(self, info: ChunkInfo) -> torch.Tensor:
        """The whole chunk in fp32 in host memory, from the parameters (wherever they are: a
        model held in host memory is read there, so only its chunks reach the device) or
        ``read_param``."""
        with device_wall.host_allocations():  # assembled in host memory, whatever the device
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

    def _training(self, master: torch.Tensor, segments: list[Segment], persistent: bool, index: int) -> ShardTraining:
        numel = master.numel()
        nvme = self.tiers.nvme if self.tiers.nvme is not None and self.tiers.nvme.holds(index) else None
        grad_in_file = nvme is not None and nvme.gradients is not None
        kept = (persistent or self.keeps_gradients) and not grad_in_file
        grad_shard = self._zeros(numel, persistent) if kept else None
        master_on_nvme = nvme is not None and master.dtype != torch.float32
        kernel_master = master
        if nvme is not None:
            states = nvme.slot_states(index)  # the chunk's state while it is resident in its slot
            if master_on_nvme:
                kernel_master, states = states[0], states[1:]
        else:
            states = tuple(self._zeros(numel, persistent) for _ in self.optimizer.state_names)
        hyper = self.hyper
        optimizer = self.optimizer.build(
            kernel_master,
            [(s.shard_offset, s.numel, hyper.weight_decay[s.param], hyper.group[s.param]) for s in segments],
            hyper=hyper,
            states=states,
        )
        return ShardTraining(
            grad_shard=grad_shard,
            optimizer=optimizer,
            nvme=nvme,
            master_on_nvme=master_on_nvme,
            grad_in_file=grad_in_file,
        )

    def _place(self, tensor: torch.Tensor, persistent: bool) -> torch.Tensor:
        """A copy of ``tensor`` where the chunk's state lives (tiers.py)."""
        return self.tiers.for_chunk(persistent=persistent).copy_of(tensor)

    def _zeros(self, numel: int, persistent: bool) -> torch.Tensor:
        """Zeroed fp32 state of ``numel`` elements where the chunk's state lives."""
        return self.tiers.for_chunk(persistent=persistent).zeros(numel)
