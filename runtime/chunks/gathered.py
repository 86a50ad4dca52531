"""Parameters read outside the forward of the module that owns them: ``engine.gathered``.

A module's parameters are on the device while its forward runs (residency.py's pre-hooks); code
that reads one anywhere else (TRL's fused loss reads ``lm_head.weight`` after the backbone; a
callback that logs a norm) would find a released parameter, which refuses the read
(released.py). ``gathered(manager, params)`` holds their chunks on the device for a block, as
DeepSpeed's ``zero.GatheredParameters`` does. A gathered parameter used in a differentiable
computation is saved by autograd like any read of chunk memory (re-gathered in backward if its
slot was reused) and its gradient takes the usual path (its chunk's reduce-scatter). Every rank
must enter the block, in the same order (the gathers are collectives).

``modify=True``: what the block wrote into these parameters is kept: rank 0's values (as
DeepSpeed's ``modifier_rank=0``) are broadcast and written into every rank's shard of the fp32
masters, so the next update and every later gather start from them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from protrain.runtime.hw.distributed import broadcast_from_main_

if TYPE_CHECKING:
    from protrain.runtime.chunks.manager import ChunkManager


@contextlib.contextmanager
def gathered(manager: ChunkManager, params: Iterable[nn.Parameter], *, modify: bool = False) -> Iterator[None]:
    """Hold the chunks of ``params`` on the device for the block (see the module docstring)."""
    store = manager.store
    wanted = list({id(param): param for param in params}.values())  # by identity: tensors compare by value
    unknown = [param for param in wanted if not store.manages(param)]
    if unknown:
        raise ValueError(
            f"engine.gathered: {len(unknown)} of the {len(wanted)} tensors given are not parameters of the "
            "engine's model (pass parameters of engine.module, e.g. model.lm_head.parameters())"
        )
    chunks = sorted({store.chunk_of(param) for param in wanted})
    offloaded = [index for index in chunks if not store.chunks[index].persistent]
    manager.residency.hold(offloaded)
    try:
        yield
        if modify:
            _write_back(manager, wanted)
    finally:
        manager.residency.let_go(offloaded)


@torch.no_grad()
def _write_back(manager: ChunkManager, params: list[nn.Parameter]) -> None:
    """Rank 0's values of ``params`` into every rank's compute copy, then each rank's part of
    them into its master shard (the stored elements of its shard)."""
    store = manager.store
    layout = store.layout
    manager.drain()  # collectives from the main thread follow a drain; no update still reads a shard
    for param in params:
        index = store.param_index(param)
        chunk = store.chunks[store.chunk_of_param[index]]
        start = chunk.share_start(layout.shard_numel, store.dist_ctx.rank)
        full = chunk.full
        assert full is not None, "a gathered chunk is on the device"
        offset = layout.slots[index].offset
        segment = full[offset : offset + param.numel()]
        broadcast_from_main_([segment], store.dist_ctx)
        low = max(offset, start)
        high = min(offset + param.numel(), start + chunk.master.numel())
        if low < high and chunk.master.data_ptr() != full.data_ptr():
            chunk.master[low - start : high - start].copy_(full[low:high])
            if chunk.master_on_nvme:  # the fp32 master in the NVMe file too
                chunk.stored_master()[low - start : high - start].copy_(full[low:high])
