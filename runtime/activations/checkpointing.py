"""The ``checkpoint`` mode: a block's activations are recomputed in backward, not kept.

A checkpointed block's forward is replaced by one that calls the original through non-reentrant
``torch.utils.checkpoint``. Its recomputation (checkpoint's unpack calling the forward again,
inside backward) runs under ``ChunkManager.recomputing()``, so the chunk manager gathers chunks
in backward order and saves no view of a buffer slot that could be reused under it. Without
gradients, or while suspended (profiling: a checkpointed block would hide what it saves from the
profiler), the original forward runs as is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.chunks.trace_labels import job_label


class BlockCheckpointing:
    """Patches blocks' forwards for the ``checkpoint`` mode and restores them.

    ``in_forward`` tells whether the engine's forward is running: a call outside it is the
    recomputation, inside backward.
    """

    def __init__(self, *, chunks: ChunkManager, in_forward: Callable[[], bool]) -> None:
        self._chunks = chunks
        self._in_forward = in_forward
        self._patched: list[nn.Module] = []
        self._suspended = False

    def patch(self, block: nn.Module, index: int) -> None:
        """Run ``block`` (the ``index``-th) under non-reentrant checkpointing: its forward is
        replaced by one that calls the original through ``torch.utils.checkpoint`` (restored by
        ``restore``). Its recomputation runs under the trace label ``protrain.recompute.<index>``."""
        original = block.forward

        def run(*args: Any, **kwargs: Any) -> Any:
            if self._in_forward():
                return original(*args, **kwargs)
            # Called again by checkpoint's unpack: this is the recomputation, inside backward.
            with self._chunks.recomputing(), job_label("recompute", index):
                return original(*args, **kwargs)

        def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
            if self._suspended or not torch.is_grad_enabled():
                return original(*args, **kwargs)
            return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed_forward  # type: ignore[method-assign]
        self._patched.append(block)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The patched blocks run their original forward (keep) for a while."""
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False

    def restore(self) -> None:
        """Give every patched block its own forward back."""
        for block in self._patched:
            del block.forward  # the instance attribute; the class's forward shows again
        self._patched.clear()
