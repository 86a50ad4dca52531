"""A chunk's full copy from every rank's shard: the one all-gather behind every fetch and
refresh (residency.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from protrain.runtime.hw.distributed import all_gather_flat

if TYPE_CHECKING:
    from protrain.runtime.chunks.staging import Staged
    from protrain.runtime.chunks.store import ChunkStore


def gather_shard(store: ChunkStore, master: torch.Tensor, out: torch.Tensor, *, staged: Staged | None = None) -> None:
    """This rank's shard (its stored elements) into its place in ``out`` in the compute dtype,
    then (several ranks) the all-gather of the others' in place. A host shard goes up from pinned
    memory, ``non_blocking``; one in fp32 from the ``staged`` buffer it was downcast into (before
    this runs), so the upload sends the compute dtype's bytes and makes no fp32 temporary on the
    device."""
    world = store.dist_ctx.world_size
    shard = store.layout.shard_numel
    whole = out
    if world > 1 and out.numel() < store.layout.chunk_numel:
        # A frozen persistent copy holds its used elements only (refreshed after a load or a
        # plan switch): the collective needs the padded chunk, for this call alone.
        whole = torch.zeros(store.layout.chunk_numel, dtype=out.dtype, device=out.device)
    mine = whole if world == 1 else whole[store.dist_ctx.rank * shard :][:shard]
    # A host shard holds the real elements only (a prefix): the rest of ``mine`` is padding,
    # which nothing reads.
    stored = master.numel()
    if staged is not None:
        mine[:stored].copy_(staged.buffer[:stored], non_blocking=True)
    else:
        mine[:stored].copy_(master, non_blocking=True)
    if world > 1:
        all_gather_flat(whole, mine, store.dist_ctx.group)
        if whole is not out:
            out.copy_(whole[: out.numel()])
