"""What every optimizer rule's kernel works on: one flat fp32 shard of a chunk, its parameters
as segments, per-group learning rates, and the contract the chunk engine calls
(``ShardOptimizer``). The rules themselves: rule.py and registry.py; AdamW: adamw.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

# Dtypes a compute copy may have; the master and its moments are always fp32.
COPY_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Segment(NamedTuple):
    """One parameter's place in a flat shard: elements ``[start, start + numel)``, its weight
    decay, and its parameter group (``optimizer.groups``: whose learning rate and betas it takes;
    0 is the top-level values)."""

    start: int
    numel: int
    weight_decay: float
    group: int = 0


GroupValues = float | Sequence[float]
"""A learning rate for every group, or one per group (indexed by ``Segment.group``)."""


class ShardOptimizer(Protocol):
    """An optimizer over one flat fp32 shard (host or device), exactly as its torch reference
    updates separate parameters: a segment marked inactive in a step (its parameter got no
    gradient) is skipped as torch skips a parameter whose ``.grad`` is None."""

    segments: tuple[Segment, ...]
    steps: torch.Tensor
    """Per segment, float32: the updates it has had (torch's ``state['step']``)."""

    @property
    def states(self) -> tuple[torch.Tensor, ...]:
        """The flat state tensors, shaped like the master, in the rule's ``state_names`` order."""
        ...

    def step_(
        self,
        grad_flat: torch.Tensor,
        active: Sequence[bool],
        lr: GroupValues | None = None,
        *,
        copy_out: torch.Tensor | None = None,
    ) -> None:
        """One update of the active segments, in place; ``copy_out`` mirrors the master after it."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def alias_segment(flat: torch.Tensor, segment: Segment) -> nn.Parameter:
    """An ``nn.Parameter`` sharing storage with ``flat[start:start + numel]``.

    ``nn.Parameter(view)`` would also share storage, but ``_make_subclass`` states the intent and
    yields a leaf without autograd history, which is what the optimizer requires.
    """
    view = flat.narrow(0, segment.start, segment.numel)
    param = torch.Tensor._make_subclass(nn.Parameter, view, True)
    assert param.data_ptr() == view.data_ptr(), "parameter does not alias the master"
    return param


def check_master(master: torch.Tensor) -> None:
    if master.dtype != torch.float32 or master.dim() != 1 or not master.is_contiguous():
        raise ValueError(
            f"the master must be a contiguous 1-D float32 tensor, got {master.dtype} with shape "
            f"{tuple(master.shape)}: pass the chunk shard's flat fp32 master"
        )
    if master.requires_grad:
        raise ValueError("the master must not require grad: pass master.detach()")


def check_segments(
    segments: Sequence[tuple[int, int, float] | tuple[int, int, float, int]], *, numel: int
) -> tuple[Segment, ...]:
    """Segments as given (any order), validated: inside the shard, non-empty, not overlapping."""
    checked = tuple(
        Segment(int(entry[0]), int(entry[1]), float(entry[2]), int(entry[3]) if len(entry) > 3 else 0)
        for entry in segments
    )
    for segment in checked:
        if segment.numel <= 0 or segment.start < 0 or segment.start + segment.numel > numel:
            raise ValueError(f"{segment} does not lie inside the shard of {numel} elements")
        if segment.weight_decay < 0.0:
            raise ValueError(f"{segment}: weight_decay must be >= 0")
        if segment.group < 0:
            raise ValueError(f"{segment}: group must be >= 0")
    ordered = sorted(checked)
    for left, right in zip(ordered, ordered[1:], strict=False):
        if left.start + left.numel > right.start:
            raise ValueError(f"{left} overlaps {right}: each element belongs to one parameter")
    return checked


def split_plan(segments: Sequence[Segment], *, numel: int) -> tuple[list[int], list[int]]:
    """Sizes that cut a flat shard into segments and the gaps around them (zero-sized where there
    is none), and the index of each segment's piece among them."""
    sizes: list[int] = []
    piece_of_segment = [0] * len(segments)
    end = 0
    for index in sorted(range(len(segments)), key=lambda i: segments[i].start):
        segment = segments[index]
        sizes.append(segment.start - end)
        piece_of_segment[index] = len(sizes)
        sizes.append(segment.numel)
        end = segment.start + segment.numel
    sizes.append(numel - end)
    return sizes, piece_of_segment


def per_group(value: GroupValues, num_groups: int, name: str) -> tuple[float, ...]:
    """One value per group from one value or a sequence of at least ``num_groups`` (a shard may
    hold no parameter of the last groups)."""
    if isinstance(value, int | float):
        return (float(value),) * num_groups
    values = tuple(float(v) for v in value)
    if len(values) < num_groups:
        raise ValueError(f"{name} has {len(values)} values for {num_groups} parameter groups")
    return values


def check_step_inputs(
    master: torch.Tensor,
    num_segments: int,
    grad_flat: torch.Tensor,
    active: Sequence[bool],
    lr: GroupValues | None,
    copy_out: torch.Tensor | None,
    *,
    num_groups: int,
) -> None:
    """What every kernel's ``step_`` checks of its arguments, with a message saying what it needs."""
    if grad_flat.shape != master.shape or grad_flat.dtype != master.dtype:
        raise ValueError(
            f"grad_flat must be {master.dtype} of shape {tuple(master.shape)} like the master, "
            f"got {grad_flat.dtype} of shape {tuple(grad_flat.shape)}"
        )
    if grad_flat.device != master.device or not grad_flat.is_contiguous():
        raise ValueError(f"grad_flat must be contiguous on {master.device}, like the master")
    if len(active) != num_segments:
        raise ValueError(f"active has {len(active)} flags for {num_segments} segments")
    if lr is not None:
        for group_lr in per_group(lr, num_groups, "lr"):
            if not group_lr >= 0.0:
                raise ValueError(f"lr must be >= 0, got {lr}")
    if copy_out is not None and (copy_out.shape != master.shape or copy_out.dtype not in COPY_OUT_DTYPES):
        raise ValueError(
            f"copy_out must have shape {tuple(master.shape)} and a dtype in {COPY_OUT_DTYPES}, "
            f"got {copy_out.dtype} of shape {tuple(copy_out.shape)}"
        )
