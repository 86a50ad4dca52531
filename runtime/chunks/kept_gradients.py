"""Where the host side of a step finds a chunk's kept gradient: its gradient shard, or, for an
NVMe chunk, its gradient file through one of the tier's host buffers (nvme_grads.py)."""

from __future__ import annotations

import contextlib

import torch

from protrain.runtime.chunks.nvme_grads import NvmeGradients
from protrain.runtime.chunks.store import Chunk


class KeptGradients:
    """The kept gradients of one store's trainable chunks, for the optimizer's jobs."""

    def __init__(self, files: NvmeGradients | None) -> None:
        self.files = files

    def in_file(self, chunk: Chunk) -> bool:
        return self.files is not None and self.files.holds(chunk.index)

    def held(self, chunk: Chunk, *, writes: bool) -> contextlib.AbstractContextManager[torch.Tensor]:
        """The chunk's gradient for one job: an NVMe chunk's read into a host buffer (unless the
        buffer holds it or it is zero) and, when the job ``writes`` it, written back behind."""
        if self.files is not None and self.files.holds(chunk.index):
            return self.files.held(chunk.index, writes=writes)
        return contextlib.nullcontext(chunk.grad_shard)

    def zero(self, chunk: Chunk, grad: torch.Tensor | None = None) -> None:
        """The chunk's gradient is zero from now on (an NVMe chunk's file is not written)."""
        if self.files is not None and self.files.holds(chunk.index):
            self.files.zero(chunk.index)
        else:
            (chunk.grad_shard if grad is None else grad).zero_()
