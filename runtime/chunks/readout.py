"""Reading the model out of its chunks one chunk at a time: what saves and exports stream from.

Every save of the model (``engine.state_dict()``, ``engine.export`` in each of its forms, a
Trainer's ``save_model``) reads the full-precision parameters out of the chunks. Gathering them
all first would hold the whole model at once, on the device where the all-gathers run: 27 GiB
for a 7B model, beyond any device that needs ProTrain. A readout instead goes chunk by chunk,
in chunk order, on every rank together (the gathers are collectives):

- one rank: an offloaded chunk's master already is in host memory (a view, no copy); a
  persistent one's is copied into one chunk-sized host buffer, reused (so is a replicated
  chunk's on any number of ranks: every rank holds all of it);
- several ranks: this rank's shard goes into one device buffer (padded to the collectives'
  shard size), is all-gathered into one chunk-sized device buffer, and the ranks that keep the
  values (``keep``) copy it into their host buffer.

So a readout adds at most one chunk and one shard buffer on the device and one chunk in host
memory, whatever the model's size. The buffers are made on first use and freed with the readout.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from protrain.runtime.chunks.layout import ChunkInfo
from protrain.runtime.chunks.store import ChunkStore
from protrain.runtime.hw import device_wall
from protrain.runtime.hw.distributed import all_gather_flat


class ChunkReadout:
    """Each chunk's values in full, one chunk at a time (see the module docstring)."""

    def __init__(self, store: ChunkStore, *, keep: bool = True) -> None:
        """``keep``: this rank receives the values (False: it only takes part in the gathers)."""
        self.store = store
        self.keep = keep
        self._host: dict[torch.dtype, torch.Tensor] = {}
        self._device: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def chunks(self, indices: Iterable[int] | None = None) -> Iterator[tuple[ChunkInfo, torch.Tensor | None]]:
        """(info, values) per chunk of ``indices`` (default: all), in that order: values is the
        chunk's flat contents in its master's dtype, in host memory, valid until the next chunk
        (None on a rank that does not ``keep``). Every rank must iterate the same chunks."""
        wanted = range(len(self.store.chunks)) if indices is None else indices
        for index in wanted:
            chunk = self.store.chunks[index]
            yield chunk.info, self._read(index)

    def _read(self, index: int) -> torch.Tensor | None:
        store = self.store
        chunk = store.chunks[index]
        master = chunk.stored_master()
        if store.dist_ctx.world_size == 1 or chunk.is_replicated:  # the whole chunk is here
            if store.on_host(master):
                return master  # the real elements, where the layout's offsets find them
            host = self._host_buffer(master.dtype)[: master.numel()]
            host.copy_(master)
            return host
        shard, full = self._device_buffers(master.dtype)
        shard[: master.numel()].copy_(master)
        shard[master.numel() :].zero_()
        all_gather_flat(full, shard, store.dist_ctx.group)
        if not self.keep:
            return None
        host = self._host_buffer(master.dtype)
        host.copy_(full)
        return host

    def _host_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._host:
            with device_wall.host_allocations():
                self._host[dtype] = torch.empty(self.store.layout.chunk_numel, dtype=dtype)
        return self._host[dtype]

    def _device_buffers(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._device:
            layout, device = self.store.layout, self.store.device.device
            self._device[dtype] = (
                torch.empty(layout.shard_numel, dtype=dtype, device=device),
                torch.empty(layout.chunk_numel, dtype=dtype, device=device),
            )
        return self._device[dtype]

    def close(self) -> None:
        """Free the buffers."""
        self._host.clear()
        self._device.clear()
