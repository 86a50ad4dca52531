"""The part Lion and SGD share: a rule written as ``torch._foreach_*`` ops over the views of a
flat shard's segments, batched by the hyperparameters a call takes as one scalar, and bounded
in the temporaries it makes.

torch has no fused CPU Lion, and its fused SGD takes one "first step" flag for all its
parameters, where a shard's segments may differ (a parameter that had no gradient yet). So
these rules run torch's own elementwise ops, the same ones their references run on separate
parameters, over lists of segment views: one call per op and batch, never a Python loop per
parameter in the math (``_foreach_*`` runs fused multi-tensor kernels on CUDA, a loop in C++ on
CPU).

Batches: the active segments with the same parameter group and weight decay (and, for a rule
that needs it, the same "never updated" state) share every scalar, so each op takes them as
one call. A batch covers at most ``WORKSPACE_NUMEL`` elements, a longer segment being cut into
pieces of that size, so that the temporaries an update makes (Lion's ``c``, SGD's decayed
gradient) stay a few MiB beside a persistent chunk on the device instead of a chunk's worth.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from protrain.runtime.optim.rule import OptimizerHyper
from protrain.runtime.optim.shard import (
    GroupValues,
    Segment,
    check_master,
    check_segments,
    check_step_inputs,
    per_group,
)

WORKSPACE_NUMEL = 1 << 18
"""Elements per batch: each temporary of an update is at most this long (1 MiB in fp32)."""


@dataclass(frozen=True, slots=True)
class Batch:
    """Pieces of active segments that share every scalar of an update."""

    group: int
    weight_decay: float
    first: bool
    """None of its segments was updated before (SGD's momentum buffer starts as the gradient)."""
    pieces: tuple[int, ...]
    """Indices into the shard's pieces (``ForeachShard.pieces``)."""


class ForeachShard:
    """A rule over one flat fp32 shard (runtime/optim/shard.py's ``ShardOptimizer``) written as
    ``_foreach`` ops per :class:`Batch`; a subclass writes ``_update`` and says how many state
    tensors it keeps."""

    num_states: ClassVar[int]
    first_update_differs: ClassVar[bool] = False
    """Whether a segment's first update differs from the later ones (batches split on it)."""

    def __init__(
        self,
        master: torch.Tensor,
        segments: Sequence[tuple[int, int, float] | tuple[int, int, float, int]],
        *,
        hyper: OptimizerHyper,
        states: tuple[torch.Tensor, ...],
        workspace_numel: int = WORKSPACE_NUMEL,
    ) -> None:
        check_master(master)
        self.master = master
        self.segments: tuple[Segment, ...] = check_segments(segments, numel=master.numel())
        num_groups = 1 + max((s.group for s in self.segments), default=0)
        self.lrs = per_group(hyper.lrs, num_groups, "lr")
        if len(hyper.betas) < num_groups:
            raise ValueError(f"betas has {len(hyper.betas)} pairs for {num_groups} parameter groups")
        self.betas = tuple((float(b1), float(b2)) for b1, b2 in hyper.betas)
        self.hyper = hyper
        if len(states) != self.num_states:
            raise ValueError(f"{type(self).__name__} keeps {self.num_states} state tensors, got {len(states)}")
        for state in states:
            if state.shape != master.shape or state.dtype != master.dtype or state.device != master.device:
                raise ValueError("each state tensor must have the master's shape, dtype and device")
        self._states = tuple(states)
        # On the host wherever the master is: the kernel reads the counts to tell first updates,
        # and a device tensor would make every step wait for the device.
        self.steps = torch.zeros(len(self.segments), dtype=torch.float32)
        if workspace_numel < 1:
            raise ValueError(f"workspace_numel must be >= 1, got {workspace_numel}")
        self.workspace_numel = workspace_numel
        self._piece_ranges, self._pieces_of_segment = _cut(self.segments, workspace_numel)
        self._piece_sizes = _split_sizes(self._piece_ranges, master.numel())
        self._master_pieces = self._views(master)
        self._state_pieces = tuple(self._views(state) for state in self._states)

    @property
    def states(self) -> tuple[torch.Tensor, ...]:
        return self._states

    def step_counts(self) -> list[int]:
        return [int(step) for step in self.steps.tolist()]

    @torch.no_grad()
    def step_(
        self,
        grad_flat: torch.Tensor,
        active: Sequence[bool],
        lr: GroupValues | None = None,
        *,
        copy_out: torch.Tensor | None = None,
    ) -> None:
        """One update of the active segments in place; ``copy_out`` mirrors the master after it."""
        check_step_inputs(self.master, len(self.segments), grad_flat, active, lr, copy_out, num_groups=len(self.lrs))
        lrs = self.lrs if lr is None else per_group(lr, len(self.lrs), "lr")
        if any(active):
            grad_pieces = self._views(grad_flat)
            for batch in self._batches(active):
                grads = [grad_pieces[index] for index in batch.pieces]
                self._update(batch, grads, lr=lrs[batch.group])
            self.steps += torch.tensor(active, dtype=torch.float32)
        if copy_out is not None:
            copy_out.copy_(self.master)

    def _update(self, batch: Batch, grads: list[torch.Tensor], *, lr: float) -> None:
        raise NotImplementedError

    def master_pieces(self, batch: Batch) -> list[torch.Tensor]:
        return [self._master_pieces[index] for index in batch.pieces]

    def state_pieces(self, batch: Batch, state: int) -> list[torch.Tensor]:
        return [self._state_pieces[state][index] for index in batch.pieces]

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The pieces of ``flat`` (one split call; the gaps between pieces dropped)."""
        parts = flat.split_with_sizes(self._piece_sizes)
        return list(parts[1::2])

    def _batches(self, active: Sequence[bool]) -> Iterator[Batch]:
        firsts = [step == 0.0 for step in self.steps.tolist()] if self.first_update_differs else None
        by_key: dict[tuple[int, float, bool], list[int]] = {}
        for index, (segment, on) in enumerate(zip(self.segments, active, strict=True)):
            if on:
                key = (segment.group, segment.weight_decay, bool(firsts and firsts[index]))
                by_key.setdefault(key, []).extend(self._pieces_of_segment[index])
        for (group, decay, first), pieces in by_key.items():
            batch: list[int] = []
            filled = 0
            for piece in pieces:
                numel = self._piece_ranges[piece][1]
                if batch and filled + numel > self.workspace_numel:
                    yield Batch(group, decay, first, tuple(batch))
                    batch, filled = [], 0
                batch.append(piece)
                filled += numel
            yield Batch(group, decay, first, tuple(batch))

    def state_dict(self) -> dict[str, Any]:
        """Per segment: its place, step count and views of its state (aliasing the live state,
        as ``torch.optim.Optimizer.state_dict`` does)."""
        steps = self.step_counts()
        return {
            "segments": [
                {
                    "start": segment.start,
                    "numel": segment.numel,
                    "weight_decay": segment.weight_decay,
                    "group": segment.group,
                    "step": steps[index],
                    "states": [state.narrow(0, segment.start, segment.numel) for state in self._states],
                }
                for index, segment in enumerate(self.segments)
            ]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy a :meth:`state_dict` of a shard with the same segments into this one."""
        entries = state["segments"]
        saved = [(int(e["start"]), int(e["numel"]), float(e["weight_decay"]), int(e["group"])) for e in entries]
        if saved != [tuple(segment) for segment in self.segments]:
            raise ValueError("the state was saved from another chunk layout: load the one saved from this layout")
        with torch.no_grad():
            for index, (entry, segment) in enumerate(zip(entries, self.segments, strict=True)):
                for live, value in zip(self._states, entry["states"], strict=True):
                    live.narrow(0, segment.start, segment.numel).copy_(value)
                self.steps[index] = float(entry["step"])


def _cut(segments: Sequence[Segment], limit: int) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """The shard's pieces, (start, numel) in shard order, no longer than ``limit``; and each
    segment's piece indices."""
    ranges: list[tuple[int, int]] = []
    order = sorted(range(len(segments)), key=lambda i: segments[i].start)
    pieces_of: list[list[int]] = [[] for _ in segments]
    for index in order:
        segment = segments[index]
        for offset in range(0, segment.numel, limit):
            pieces_of[index].append(len(ranges))
            ranges.append((segment.start + offset, min(limit, segment.numel - offset)))
    return ranges, pieces_of


def _split_sizes(ranges: Sequence[tuple[int, int]], numel: int) -> list[int]:
    """Sizes that cut a flat tensor into gap, piece, gap, piece, ..., gap (zero-sized gaps where
    pieces touch)."""
    sizes: list[int] = []
    end = 0
    for start, length in ranges:
        sizes += [start - end, length]
        end = start + length
    sizes.append(numel - end)
    return sizes
