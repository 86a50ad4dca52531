"""Averaging gradients over the ranks, with the 1/world factor applied where it costs no pass.

A reduction averages each gradient over the ranks: their sum divided by their number. DDP folds
the division into the copy of each gradient into its bucket; a division after the collective
reads and writes the whole reduced buffer once more (on two CPU ranks the replicated default
model's division took about 0.4% of its step, on the cores compute needs).

Where the number of ranks is a power of two and the dtype has fp32's exponent range (fp32, bf16,
fp64), multiplying by 1/world only moves the exponent, so it is exact and commutes with every
rounding of the sum: the ranks' gradients each multiplied by 1/world sum to the same bits as
their sum divided by world, in any summation order (outside the subnormal range, where a
multiplied gradient may lose low bits, as the divided sum may). There the factor is applied as
each gradient enters the buffer the collective reads (``torch.mul(..., out=)`` in place of its
copy, ``add_(alpha=)`` in place of its add) and no pass follows the collective. Otherwise (three
ranks; fp16, whose small gradients would turn subnormal) the division after stays.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from protrain.runtime.hw.distributed import all_reduce_flat_, reduce_scatter_flat_, reduce_scatter_into

_EXACT_SCALING_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def scales_on_entry(world: int, dtype: torch.dtype) -> bool:
    """Whether gradients of ``dtype`` averaged over ``world`` ranks take the factor on entry."""
    return world > 1 and world & (world - 1) == 0 and dtype in _EXACT_SCALING_DTYPES


class RankAverage:
    """The average over the ranks of one group, for gradients of one dtype (module docstring)."""

    def __init__(self, world: int, dtype: torch.dtype, group: dist.ProcessGroup | None) -> None:
        self.world = world
        self.group = group
        self.on_entry = scales_on_entry(world, dtype)
        self._factor = 1.0 / world

    @torch.no_grad()
    def enter_(self, region: torch.Tensor, grad: torch.Tensor) -> None:
        """A gradient's first arrival into ``region`` (same shape) of what a collective reads."""
        if self.on_entry:
            torch.mul(grad, self._factor, out=region)
        else:
            region.copy_(grad)

    @torch.no_grad()
    def add_(self, region: torch.Tensor, grad: torch.Tensor) -> None:
        """A further gradient into ``region``, where ``enter_`` put the first."""
        if self.on_entry:
            region.add_(grad, alpha=self._factor)
        else:
            region.add_(grad)

    def whole_(self, flat: torch.Tensor, *, entered: bool = True) -> torch.Tensor:
        """``flat`` averaged in place (an all-reduce); returns it. ``entered``: every gradient
        in it came through ``enter_``/``add_`` (False: summed as they came, as a shard that
        accumulated micro-batches before the window's last backward)."""
        if self.world == 1:
            return flat
        return self._divided(all_reduce_flat_(flat, self.group), entered)

    def part_(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``flat`` averaged (a reduce-scatter; a view of ``flat``)."""
        if self.world == 1:
            return flat
        return self._divided(reduce_scatter_flat_(flat, self.group), True)

    def part_into(self, out: torch.Tensor, flat: torch.Tensor, numel: int) -> None:
        """This rank's part of ``flat`` averaged into ``out``, of which ``numel`` elements are
        real (the rest, padding, is left summed)."""
        self._divided(reduce_scatter_into(out, flat, self.group)[:numel], True)

    def _divided(self, reduced: torch.Tensor, entered: bool) -> torch.Tensor:
        return reduced if entered and self.on_entry else reduced.div_(self.world)
