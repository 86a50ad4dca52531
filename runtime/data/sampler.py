"""A resumable, rank-sharded sampler whose data position is part of a checkpoint.

The job reads one *global sample stream*. Epoch ``e`` orders the dataset of ``N`` samples by
``epoch_order(N, seed=seed, epoch=e, shuffle=shuffle)``: a ``torch.randperm`` drawn from a local
generator seeded with ``epoch_seed(seed, e)`` (never the global RNG), or ``arange(N)`` without
shuffling. A *position* is ``(epoch, offset)``, ``offset`` being the number of global samples of
epoch ``epoch`` already consumed.

One micro-step of the whole job consumes the ``W * mb`` consecutive positions
``[offset, offset + W * mb)`` (``W`` ranks, ``mb`` samples per rank and micro-batch). Rank ``r``
takes every ``W``-th of them, as ``DistributedSampler`` does: over the rest of the epoch it yields
``order[offset + r + k * W]`` for ``k = 0 .. per_rank - 1`` with
``per_rank = ((N - offset) // W // mb) * mb``. Only whole micro-steps are handed out, so a
``DataLoader(batch_size=mb)`` never gets a short batch and every rank yields the same count.
When fewer than ``W * mb`` positions remain, the epoch ends (the tail is dropped) and the next
epoch starts at offset 0; a position is always kept in this normalised form, so ``(e, N - 2)``
with a micro-step of 4 is stored as ``(e + 1, 0)``.

The sampler has two cursors, because a ``DataLoader`` with workers prefetches ahead of training:

* the *iteration cursor*: what the next ``__iter__`` yields. Each ``iter(sampler)`` hands out this
  rank's indices from the cursor to the end of that epoch and moves the cursor to ``(epoch + 1, 0)``
  at once, so ``for epoch in range(k): for batch in loader:`` walks the epochs. Two live iterators
  therefore get consecutive epochs, and an iterator abandoned mid-epoch skips the rest of its
  epoch for later iterators (the consumed position, and so a checkpoint, is unaffected).
  ``len(sampler)`` is this rank's count for the epoch the next ``__iter__`` yields.
* the *consumed position*: what the engine has trained on, advanced by ``consume`` after each
  optimizer-update window with the number of samples all ranks trained on (whole micro-steps).

``state_dict()`` saves the consumed position with ``num_samples``, ``seed`` and ``shuffle`` (plain
ints and bools); ``load_state_dict`` checks those three and puts both cursors at the saved position,
so a resumed run sees exactly the batches the uninterrupted run would have seen. ``world_size`` and
``micro_batch_size`` are deliberately not saved: a checkpoint from 2 ranks resumed on 1 continues
from the same global position, the rest of the epoch split among the new ranks (only where the
epoch's tail is dropped can the two differ, since the drop rule depends on ``W * mb``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler

_SEED_STRIDE = 1_000_003  # odd prime: distinct (seed, epoch) pairs map to distinct seeds for epoch < stride
_SEED_MASK = (1 << 64) - 1  # torch.Generator.manual_seed takes unsigned 64-bit seeds
_STATE_KEYS = ("num_samples", "seed", "shuffle", "epoch", "offset")


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of epoch ``epoch``'s shuffle: a fixed function of the job seed and epoch."""
    return (seed * _SEED_STRIDE + epoch) & _SEED_MASK


def epoch_order(num_samples: int, *, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The global sample order of one epoch: [num_samples] int64, a permutation of ``arange``."""
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator)


@dataclass(frozen=True, slots=True)
class SamplePosition:
    """A place in the global stream: ``offset`` samples of epoch ``epoch`` already consumed."""

    epoch: int
    offset: int


def normalize_position(position: SamplePosition, *, num_samples: int, step: int) -> SamplePosition:
    """``position``, or the start of the next epoch when fewer than ``step`` samples remain."""
    if num_samples - position.offset < step:
        return SamplePosition(position.epoch + 1, 0)
    return position


def advance_position(position: SamplePosition, *, num_micro_steps: int, num_samples: int, step: int) -> SamplePosition:
    """The normalised position ``num_micro_steps`` micro-steps of ``step`` samples after ``position``.

    ``position`` must be normalised. Closed form, so skipping many epochs costs nothing.
    """
    left_in_epoch = (num_samples - position.offset) // step
    if num_micro_steps < left_in_epoch:
        return SamplePosition(position.epoch, position.offset + num_micro_steps * step)
    # Finish this epoch, then whole epochs of num_samples // step micro-steps each.
    full_epochs, rest = divmod(num_micro_steps - left_in_epoch, num_samples // step)
    return SamplePosition(position.epoch + 1 + full_epochs, rest * step)


def rank_count(num_samples: int, *, offset: int, world_size: int, micro_batch_size: int) -> int:
    """Samples one rank yields from ``offset`` to the end of the epoch: whole micro-batches only."""
    return (num_samples - offset) // world_size // micro_batch_size * micro_batch_size


def _require_int(name: str, value: object, *, minimum: int) -> int:
    # bool is an int subclass; True as a world size is a bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class ShardedSampler(Sampler[int]):
    """This rank's share of the global sample stream, resumable from ``state_dict`` (see module doc).

    Use one per rank with a ``DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler)``;
    call ``consume(micro_batch_size * gradient_accumulation_steps * world_size)`` after each
    optimizer update and save ``state_dict()`` with the checkpoint.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        world_size: int,
        rank: int,
        micro_batch_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        self.num_samples = _require_int("num_samples", num_samples, minimum=1)
        self.world_size = _require_int("world_size", world_size, minimum=1)
        self.rank = _require_int("rank", rank, minimum=0)
        self.micro_batch_size = _require_int("micro_batch_size", micro_batch_size, minimum=1)
        self.seed = _require_int("seed", seed, minimum=0)
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle must be a bool, got {shuffle!r}")
        self.shuffle = shuffle
        if rank >= world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if num_samples < self.step:
            raise ValueError(
                f"num_samples={num_samples} is smaller than one micro-step of the job "
                f"(world_size * micro_batch_size = {self.step}), so no rank would get a batch; "
                "use a larger dataset, fewer ranks or a smaller micro_batch_size"
            )
        self._consumed = SamplePosition(0, 0)
        self._cursor = SamplePosition(0, 0)

    @property
    def step(self) -> int:
        """Global samples in one micro-step of the whole job: ``world_size * micro_batch_size``."""
        return self.world_size * self.micro_batch_size

    def __len__(self) -> int:
        return rank_count(
            self.num_samples,
            offset=self._cursor.offset,
            world_size=self.world_size,
            micro_batch_size=self.micro_batch_size,
        )

    def __iter__(self) -> Iterator[int]:
        # Indices are taken and the cursor moved now, not at the first next(): len() and a second
        # iter() then agree with what this iterator will yield, whenever the DataLoader pulls it.
        position, count = self._cursor, len(self)
        self._cursor = SamplePosition(position.epoch + 1, 0)
        order = epoch_order(self.num_samples, seed=self.seed, epoch=position.epoch, shuffle=self.shuffle)
        start = position.offset + self.rank
        return iter(order[start : start + count * self.world_size : self.world_size].tolist())

    def consume(self, global_samples: int) -> None:
        """Advance the consumed position by ``global_samples`` trained on by all ranks together.

        The count must be whole micro-steps (a multiple of ``world_size * micro_batch_size``); an
        epoch's dropped tail is skipped as ``__iter__`` skips it.
        """
        _require_int("consume(global_samples)", global_samples, minimum=0)
        if global_samples % self.step:
            raise ValueError(
                f"consume({global_samples}): the count must be whole micro-steps of the job, a "
                f"multiple of world_size * micro_batch_size = {self.step}; pass "
                "micro_batch_size * gradient_accumulation_steps * world_size per update"
            )
        self._consumed = advance_position(
            self._consumed,
            num_micro_steps=global_samples // self.step,
            num_samples=self.num_samples,
            step=self.step,
        )

    def state_dict(self) -> dict[str, int | bool]:
        """The consumed position and what it depends on, as plain JSON-able values."""
        return {
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self._consumed.epoch,
            "offset": self._consumed.offset,
        }

    def load_state_dict(self, state: Mapping[str, int | bool]) -> None:
        """Continue from a saved consumed position: both cursors move there.

        The position is normalised for this sampler's micro-step, so resuming on more ranks than
        the checkpoint had starts the next epoch when the rest of this one is too short for them.
        """
        self._check_state_keys(state)
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key) or type(state[key]) is not type(getattr(self, key)):
                raise ValueError(
                    f"sampler state {key!r} does not match: the checkpoint has {state[key]!r}, this "
                    f"sampler has {getattr(self, key)!r}; build the sampler with {key}={state[key]!r} "
                    "to resume this run, or start a new run without loading the sampler state"
                )
        epoch = _require_int("sampler state 'epoch'", state["epoch"], minimum=0)
        offset = _require_int("sampler state 'offset'", state["offset"], minimum=0)
        if offset > self.num_samples:
            raise ValueError(f"sampler state 'offset'={offset} is past num_samples={self.num_samples}")
        position = normalize_position(SamplePosition(epoch, offset), num_samples=self.num_samples, step=self.step)
        self._consumed = position
        self._cursor = position

    @staticmethod
    def _check_state_keys(state: Mapping[str, int | bool]) -> None:
        missing = [key for key in _STATE_KEYS if key not in state]
        extra = sorted(key for key in state if key not in _STATE_KEYS)
        if missing or extra:
            raise ValueError(
                f"sampler state has missing keys {missing} and unexpected keys {extra}; "
                f"expected exactly {list(_STATE_KEYS)} as written by ShardedSampler.state_dict()"
            )
