"""Adding a 16-bit gradient into an fp32 shard in host memory: widened first, a slice at a time.

torch's mixed-dtype ``add_`` (fp32 += bf16) has no vectorised CPU path: it is several times
slower than widening into fp32 and adding fp32 to fp32 (docs/decisions/0005-widened-gradient-adds.md).
The host worker adds every reduced gradient of every micro-batch that keeps gradients,
so it widens into a small reused fp32 scratch (``WIDEN_SLICE_NUMEL`` elements, counted in the
plan's host bytes) and adds slice by slice; the sums are the same, bit for bit (the mixed add
widens each element to fp32 too).
"""

from __future__ import annotations

import torch

from protrain.profiler.host_bytes import WIDEN_SLICE_NUMEL

__all__ = ["WIDEN_SLICE_NUMEL", "add_widened"]


def add_widened(shard: torch.Tensor, gradient: torch.Tensor, scratch: torch.Tensor | None) -> None:
    """``shard += gradient`` (same number of elements), through ``scratch`` (fp32, any length)
    when the dtypes differ."""
    if gradient.dtype == shard.dtype or scratch is None:
        shard.add_(gradient)
        return
    step = scratch.numel()
    total = gradient.numel()
    for start in range(0, total, step):
        count = min(step, total - start)
        widened = scratch[:count]
        widened.copy_(gradient[start : start + count])
        shard[start : start + count].add_(widened)
