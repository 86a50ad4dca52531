"""Moving training state from one chunk layout to another, in memory: what a re-plan needs.

A new plan may pack the parameters into chunks of another size and shard them differently, so
each rank's new shard holds pieces that other ranks held before. The move keeps the device
within one layout: first the old layout's state goes to host memory (``hold_on_host``: the
persistent chunks' shards are copied there, the offloaded ones are there already) and the old
manager lets go of every device tensor (its persistent copies and shards, its buffer slots);
only then is the new layout built (``apply_plan``), and every old chunk gathered in full once
(fp32 master and Adam moments; a frozen chunk's stored dtype), in chunk order on every rank,
each rank copying out the pieces its new shards hold (``move_state``). Per-parameter step
counts are agreed by a max over ranks (a rank holding none of a parameter learns it from the
others). Device memory beyond the new layout: one old chunk, while it is gathered (several
ranks). Host memory: each old chunk's host pages go back to the kernel once its state has moved,
so beyond the new layout only the old state not yet moved is held, and one old chunk three
times. Nothing changes the values: after the move every parameter, moment and step count is
what it was (checked by the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protrain.runtime.chunks.layout import ChunkInfo, ChunkLayout
from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.chunks.store import Chunk, Segment, padded_shard
from protrain.runtime.hw import device_wall
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.distributed import DistContext, all_gather_flat, all_reduce_sum_
from protrain.runtime.hw.host_memory import MmapArena


@dataclass(frozen=True, slots=True)
class HeldChunk:
    """One old chunk's state on this rank, in host memory."""

    info: ChunkInfo
    segments: list[Segment]
    state: list[torch.Tensor]
    """The master shard, then (trainable) the two moments: this rank's stored elements."""
    steps: torch.Tensor | None
    """Per segment, the updates it has had (trainable chunks)."""
    replicated: bool = False
    """``state`` holds the whole chunk (a replicated chunk), not this rank's shard."""


@dataclass(frozen=True, slots=True)
class HeldState:
    """An old layout's training state, all of it in host memory (see the module docstring)."""

    layout: ChunkLayout
    chunks: list[HeldChunk]
    device: DeviceInfo
    arena: MmapArena | None
    """The old offloaded chunks' host region: its pages go back as their state moves."""


@torch.no_grad()
def hold_on_host(old: ChunkManager) -> HeldState:
    """``old``'s state in host memory; ``old`` then holds no device memory (call ``old.close()``
    first: its workers are stopped; what it held on the host stays until the state is dropped)."""
    chunks = []
    for chunk in old.chunks:
        state = [t if old.store.on_host(t) else _host_copy(t) for t in chunk.state_tensors()]
        steps = None if chunk.training is None else _host_copy(chunk.optimizer.steps)
        chunks.append(HeldChunk(chunk.info, chunk.segments, state, steps, replicated=chunk.is_replicated))
    old.release_device()
    return HeldState(layout=old.layout, chunks=chunks, device=old.device, arena=old.store.host_arena)


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    with device_wall.host_allocations():
        out = torch.empty(tensor.shape, dtype=tensor.dtype)
    out.copy_(tensor)
    return out


def _whole(stored: torch.Tensor, old: HeldState) -> torch.Tensor:
    """A replicated chunk's held state (its real elements) padded to the whole chunk, on the host."""
    with device_wall.host_allocations():
        return padded_shard(stored, old.layout.chunk_numel, torch.device("cpu")).clone()


def _full(shard: torch.Tensor, old: HeldState, dist_ctx: DistContext) -> torch.Tensor:
    """The whole chunk from every rank's ``shard`` (host: its real elements only), on the host."""
    shard_numel = old.layout.shard_numel
    if dist_ctx.world_size == 1:
        with device_wall.host_allocations():
            return padded_shard(shard, shard_numel, torch.device("cpu")).clone()
    local = padded_shard(shard, shard_numel, old.device.device)
    full = torch.empty(old.layout.chunk_numel, dtype=local.dtype, device=old.device.device)
    all_gather_flat(full, local, dist_ctx.group)
    return _host_copy(full)


@torch.no_grad()
def move_state(old: HeldState, new: ChunkManager, dist_ctx: DistContext) -> None:
    """Copy every parameter's master, moments and step count from ``old`` into ``new`` (built
    over the same parameters, in any order). Every rank calls it."""
    if sorted(info.name for info in old.layout.params) != sorted(info.name for info in new.layout.params):
        raise ValueError("the two layouts pack different parameters")
    # Where each parameter's elements land in this rank's new shards, by the old layout's index
    # (the new one may pack them in another order).
    old_index = {info.name: index for index, info in enumerate(old.layout.params)}
    targets: dict[int, list[tuple[Chunk, int, int, int]]] = {}
    for chunk in new.chunks:
        for segment in chunk.segments:
            targets.setdefault(old_index[new.layout.params[segment.param].name], []).append(
                (chunk, segment.shard_offset, segment.param_offset, segment.numel)
            )
    for held in old.chunks:
        fulls = [_whole(tensor, old) if held.replicated else _full(tensor, old, dist_ctx) for tensor in held.state]
        for index in held.info.params:
            start = old.layout.slots[index].offset
            for chunk, shard_offset, param_offset, numel in targets.get(index, []):
                source = start + param_offset
                for full, destination in zip(fulls, chunk.state_tensors(), strict=False):
                    piece = full[source : source + numel]
                    destination[shard_offset : shard_offset + numel].copy_(piece)
        del fulls
        # Moved: the old copy goes, so host memory holds one layout's state and one chunk.
        for tensor in held.state:
            if old.arena is not None and old.arena.contains(tensor):
                old.arena.give_back(tensor)
        held.state.clear()
    count = len(old.layout.params)
    steps = torch.zeros(count, dtype=torch.float64)  # by the old layout's index
    holders = torch.zeros(count, dtype=torch.float64)
    for held in old.chunks:
        if held.steps is None:
            continue
        for position, segment in enumerate(held.segments):
            steps[segment.param] = max(float(steps[segment.param]), float(held.steps[position]))
            holders[segment.param] = 1.0
    # Every rank holding a piece of a parameter has the same count: the sum over ranks divided
    # by the number of holders is that count, known then to every rank.
    totals = all_reduce_sum_(torch.cat([steps * holders, holders]), dist_ctx)
    agreed = totals[:count] / totals[count:].clamp(min=1.0)
    for chunk in new.trainable_chunks():
        for position, segment in enumerate(chunk.segments):
            chunk.optimizer.steps[position] = float(agreed[old_index[new.layout.params[segment.param].name]])
    for chunk in new.chunks:
        chunk.refresh_copy()  # masters moved into NVMe files: their compute copies
    new.refresh_full_copies(frozen_too=True)
