"""Averaging gradients across ranks at the end of an accumulation window.

A parameter that got no gradient on any rank keeps ``grad=None`` so AdamW skips it, exactly as
``torch.optim.AdamW`` would in single-process training. A parameter that got a gradient on some
ranks only is averaged with zeros from the others.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.distributed import DistContext, all_reduce_sum_

BUCKET_BYTES = 32 << 20


def average_gradients_(params: list[nn.Parameter], ctx: DistContext, extras: torch.Tensor) -> torch.Tensor:
    """Average every parameter's gradient across ranks in place; ``extras`` (a small float64
    vector of per-rank counters) is summed in the same first collective and returned."""
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.float64)
    header = torch.cat([has_grad, extras.to(torch.float64)])
    all_reduce_sum_(header, ctx)
    anywhere = (header[: len(params)] > 0).tolist()
    with_grad = [param for param, present in zip(params, anywhere, strict=True) if present]
    for param in with_grad:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    if ctx.world_size > 1:
        for bucket in _buckets(with_grad):
            grads = [p.grad for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            all_reduce_sum_(flat, ctx)
            flat.div_(ctx.world_size)
            offset = 0
            for grad in grads:
                count = grad.numel()
                grad.copy_(flat[offset : offset + count].view_as(grad))
                offset += count
    return header[len(params) :]


def _buckets(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Group consecutive parameters of one dtype into buckets of about BUCKET_BYTES."""
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        if current and (size + nbytes > BUCKET_BYTES or param.grad.dtype != current[0].grad.dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(param)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
