"""The engine's data position: one resumable sampler per engine, and a DataLoader over it.

The sampler's position is saved with every checkpoint and restored on resume (also when the
sampler is made after the checkpoint was loaded), so a resumed run sees exactly the batches the
uninterrupted run would have.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from protrain.runtime.data.sampler import ShardedSampler
from protrain.runtime.hw.distributed import DistContext


class DataPosition:
    """This rank's sampler (made on request, once) and the position a checkpoint gave it."""

    def __init__(self, dist_ctx: DistContext, *, micro_batch_size: int, seed: int) -> None:
        self.world_size = dist_ctx.world_size
        self.rank = dist_ctx.rank
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.sampler: ShardedSampler | None = None
        self._resumed: dict[str, Any] | None = None

    def data_sampler(self, num_samples: int, *, shuffle: bool = True) -> ShardedSampler:
        """A sampler over a dataset of ``num_samples`` for this rank (batch size
        ``micro_batch_size``) whose position is saved with every checkpoint and restored on
        resume, so a resumed run sees exactly the batches the uninterrupted run would have. Give
        the DataLoader a ``generator`` of its own, or use ``data_loader``."""
        if self.sampler is not None:
            raise RuntimeError("engine.data_sampler() was already called: one sampler per engine")
        sampler = ShardedSampler(
            num_samples,
            world_size=self.world_size,
            rank=self.rank,
            micro_batch_size=self.micro_batch_size,
            seed=self.seed,
            shuffle=shuffle,
        )
        if self._resumed is not None:
            sampler.load_state_dict(self._resumed)
        self.sampler = sampler
        return sampler

    def data_loader(self, dataset: Dataset[Any], **loader_args: Any) -> DataLoader[Any]:
        """A ``DataLoader`` over ``dataset`` with this rank's resumable ``data_sampler`` and
        ``micro_batch_size``; other arguments (``num_workers``, ``collate_fn``...) pass through.
        It draws its worker seeds from a generator of its own: a plain DataLoader draws them from
        the global random stream each time it starts an epoch, so a resumed run, which starts
        one at a different step, would see different dropout masks than the uninterrupted run."""
        for taken in ("batch_size", "sampler", "shuffle", "batch_sampler"):
            if taken in loader_args:
                raise TypeError(f"data_loader sets {taken} itself (micro_batch_size and data_sampler)")
        sampler = self.data_sampler(len(dataset), shuffle=True)  # type: ignore[arg-type]
        generator = loader_args.pop("generator", None) or torch.Generator().manual_seed(self.seed)
        return DataLoader(
            dataset, batch_size=self.micro_batch_size, sampler=sampler, generator=generator, **loader_args
        )

    def consume_window(self, accumulation: int) -> None:
        """An update's window is over. The sampler hands out whole micro-batches: a window
        consumed accumulation x world x micro_batch_size of its positions, however the batch
        was passed in."""
        if self.sampler is not None:
            self.sampler.consume(self.sampler.step * accumulation)

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.sampler is None else self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The position from a checkpoint (None: it had no sampler)."""
        self._resumed = state
        if self.sampler is not None and state is not None:
            self.sampler.load_state_dict(state)
