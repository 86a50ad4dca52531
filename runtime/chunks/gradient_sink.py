"""Where reduced gradients go: the host side's whole interface to the device side of backward.

The device/host seam: the side stream (a worker thread; on CUDA it issues on a CUDA stream) runs
the device work of a reduction and nothing else (reduce.py): the reduce-scatter, then for a
persistent chunk the fp32 add into its shard on the device, or for an offloaded one a copy of
the reduced part, in the compute dtype, into a pinned buffer of a bounded staging ring
(staging.py), ``non_blocking``. What happens then is the host side's (optimizer.py), behind the
two calls of ``ReducedGradientSink`` and nothing else, so that neither side reads the other's
state: ``add_staged`` (the host worker waits for the copy, adds the buffer into the fp32 shard,
or applies it by CPU Adam where no gradient shard is kept, and hands the buffer back) and
``reduction_queued`` (told on the main thread, with the event that says when the reduced
gradient is in the shard and which parameters had a gradient, so the host side may update the
chunk early). Nothing on the device side waits on the main thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from protrain.runtime.chunks.store import Chunk
from protrain.runtime.hw.device import DeviceEvent


class ReducedGradientSink(Protocol):
    """What the host side implements (see the module docstring)."""

    def add_staged(
        self,
        chunk: Chunk,
        staged: torch.Tensor,
        copied: DeviceEvent,
        release: Callable[[], None],
        fired: torch.Tensor,
    ) -> DeviceEvent:
        """``staged`` (host, compute dtype, the chunk's stored elements) holds this rank's
        reduced part of an offloaded chunk's gradient for one micro-batch once ``copied`` has
        fired: add it into the shard, or (no gradient shard kept) apply it, off the main thread,
        then call ``release``; the returned event fires after that. ``fired[param]``: which
        parameters had a gradient in this window so far. Called on the main thread in reduction
        order."""

    def accepting(self) -> bool:
        """Whether a gradient may arrive now: False only where offloaded chunks keep no gradient
        shard and no window's last backward is armed (nothing could apply or keep it)."""

    def reduction_queued(self, chunk: Chunk, reduced: DeviceEvent, fired: torch.Tensor) -> None:
        """The chunk's reduction is queued (main thread): its gradient is in (its shard, or
        applied where no shard is kept) once ``reduced`` has fired; ``fired[param]`` says which
        parameters had a gradient in this accumulation window so far."""
