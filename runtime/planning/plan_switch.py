"""Moving training state from one chunk layout to another, in memory: what a re-plan needs.

A new plan may pack the parameters into chunks of another size and shard them differently, so
each rank's new shard holds pieces that other ranks held before. Every old chunk is gathered in
full once (fp32 master and Adam moments; a frozen chunk's stored dtype), in chunk order on every
rank, and each rank copies out the pieces its new shards hold; per-parameter step counts are
agreed by a max over ranks (a rank holding none of a parameter learns it from the others). Host
memory needed beyond both layouts: one old chunk, three times. Nothing changes the values: after
the move every parameter, moment and step count is what it was (checked by the tests).
"""

from __future__ import annotations

import torch

from runtime.chunks.manager import ChunkManager
from runtime.chunks.store import Chunk, padded_shard
from runtime.distributed import DistContext, all_gather_flat, all_reduce_sum_


def _full(shard: torch.Tensor, old: ChunkManager, dist_ctx: DistContext) -> torch.Tensor:
    """The whole chunk from every rank's ``shard`` (a host tensor: its real elements only)."""
    local = padded_shard(shard, old.layout.shard_numel, old.device.device)
    if dist_ctx.world_size == 1:
        return local.detach().to("cpu", copy=True)
    full = torch.empty(old.layout.chunk_numel, dtype=local.dtype, device=old.device.device)
    all_gather_flat(full, local, dist_ctx.group)
    return full.to("cpu")


def _state_of(chunk: Chunk) -> list[torch.Tensor]:
    return chunk.state_tensors()


@torch.no_grad()
def move_state(old: ChunkManager, new: ChunkManager, dist_ctx: DistContext) -> None:
    """Copy every parameter's master, moments and step count from ``old`` into ``new`` (built
    over the same parameters, in the same order). Every rank calls it."""
    old.drain()
    if [info.name for info in old.layout.params] != [info.name for info in new.layout.params]:
        raise ValueError("the two layouts pack different parameters")
    # Where each parameter's elements land in this rank's new shards.
    targets: dict[int, list[tuple[Chunk, int, int, int]]] = {}
    for chunk in new.chunks:
        for segment in chunk.segments:
            targets.setdefault(segment.param, []).append(
                (chunk, segment.shard_offset, segment.param_offset, segment.numel)
            )
    for old_chunk in old.chunks:
        fulls = [_full(tensor, old, dist_ctx) for tensor in _state_of(old_chunk)]
        for index in old_chunk.info.params:
            start = old.layout.slots[index].offset
            for chunk, shard_offset, param_offset, numel in targets.get(index, []):
                source = start + param_offset
                for full, destination in zip(fulls, _state_of(chunk), strict=False):
                    piece = full[source : source + numel]
                    destination[shard_offset : shard_offset + numel].copy_(piece)
    steps = torch.zeros(len(old.layout.params), dtype=torch.float64)
    for chunk in old.trainable_chunks():
        for position, segment in enumerate(chunk.segments):
            steps[segment.param] = max(float(steps[segment.param]), float(chunk.optimizer.steps[position]))
    # Every rank holding a piece of a parameter has the same count: the sum over ranks divided
    # by the number of holders is that count, known then to every rank.
    holders = torch.zeros(len(old.layout.params), dtype=torch.float64)
    for chunk in old.trainable_chunks():
        for segment in chunk.segments:
            holders[segment.param] = 1.0
    totals = all_reduce_sum_(torch.cat([steps * holders, holders]), dist_ctx)
    count = len(old.layout.params)
    agreed = totals[:count] / totals[count:].clamp(min=1.0)
    for chunk in new.trainable_chunks():
        for position, segment in enumerate(chunk.segments):
            chunk.optimizer.steps[position] = float(agreed[segment.param])
    new.refresh_full_copies(frozen_too=True)
