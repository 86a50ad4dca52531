"""Process group setup from the environment torch's launcher sets, and the few collectives the
engine issues. World size 1 runs the same code with the communication skipped."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True, slots=True, kw_only=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    owns_group: bool
    """True when ``initialize`` created the process group (and so destroys it)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None or value == "" else int(value)


def init_distributed(*, backend: str, timeout_s: float) -> DistContext:
    """Join the process group described by RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, or reuse
    one the caller already made. Without those variables this is a single-rank job."""
    local_rank = env_int("LOCAL_RANK", 0)
    if dist.is_available() and dist.is_initialized():
        return DistContext(
            rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, owns_group=False
        )
    world_size = env_int("WORLD_SIZE", 1)
    if world_size == 1:
        return DistContext(rank=0, world_size=1, local_rank=local_rank, owns_group=False)
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return DistContext(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, owns_group=True
    )


def all_reduce_sum_(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if ctx.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max_(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if ctx.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def broadcast_module_(module: nn.Module, ctx: DistContext) -> None:
    """Make every rank's parameters and buffers equal to rank 0's (as DDP does at start)."""
    if ctx.world_size == 1:
        return
    for tensor in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(tensor.data, src=0)


def broadcast_object(value: object, ctx: DistContext) -> object:
    if ctx.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def destroy(ctx: DistContext) -> None:
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()
