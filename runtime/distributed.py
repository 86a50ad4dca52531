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
    collective_device: torch.device
    """Where the backend's collectives run: host tensors are staged there for NCCL."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None or value == "" else int(value)


def init_distributed(
    *, backend: str, timeout_s: float, world_size: int, local_rank: int, collective_device: torch.device
) -> DistContext:
    """Join the process group torch's launcher described in the environment (init method
    ``env://``), or reuse one the caller already made; world size 1 needs none."""
    if dist.is_available() and dist.is_initialized():
        return DistContext(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=local_rank,
            owns_group=False,
            collective_device=collective_device,
        )
    if world_size == 1:
        return DistContext(
            rank=0, world_size=1, local_rank=local_rank, owns_group=False, collective_device=collective_device
        )
    timeout = timedelta(seconds=timeout_s)
    store = _attempt_store(world_size, timeout)
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(
            backend=backend, timeout=timeout, store=store, rank=env_int("RANK", 0), world_size=world_size
        )
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        owns_group=True,
        collective_device=collective_device,
    )


def _attempt_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """Under torch's elastic agent with its static rendezvous (protrain-run on one node), the
    ranks share the agent's store, and the agent keeps that store across restarts: a restarted
    group would read the previous attempt's addresses from it and fail to connect ("Connection
    refused"). Each attempt therefore gets its own key prefix. None: the default env:// setup."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"/protrain/attempt_{attempt}", client)


def broadcast_object(value: object, ctx: DistContext, group: dist.ProcessGroup | None = None) -> object:
    """Rank 0's ``value`` on every rank (a collective; world size 1: the value itself)."""
    if ctx.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _all_reduce_(tensor: torch.Tensor, ctx: DistContext, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    if ctx.world_size == 1:
        return tensor
    staged = tensor if tensor.device == ctx.collective_device else tensor.to(ctx.collective_device)
    dist.all_reduce(staged, op=op)
    if staged is not tensor:
        tensor.copy_(staged)
    return tensor


def all_reduce_sum_(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    return _all_reduce_(tensor, ctx, dist.ReduceOp.SUM)


def all_reduce_min_(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    return _all_reduce_(tensor, ctx, dist.ReduceOp.MIN)


def all_reduce_max(value: float, ctx: DistContext) -> float:
    """The largest of every rank's ``value``."""
    return -float(all_reduce_min_(torch.tensor([-value], dtype=torch.float64), ctx)[0])


def broadcast_module_(module: nn.Module, ctx: DistContext) -> None:
    """Make every rank's parameters and buffers equal to rank 0's (as DDP does at start)."""
    if ctx.world_size == 1:
        return
    for tensor in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(tensor.data, src=0)


def destroy(ctx: DistContext) -> None:
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor) -> None:
    """Every rank's ``shard`` concatenated into ``output`` (world size x shard elements)."""
    if _is_gloo():
        # gloo's flat all-gather stages through temporaries allocated on its own threads, which
        # glibc keeps as per-thread free memory: 8 MiB chunks left 100-160 MiB of it per rank,
        # and one broadcast per rank straight into its slice took half the time (2 ranks on 2
        # cores: 4.4 vs 8.4 ms for 8 MiB). The bytes each rank sends and receives are the same.
        size = shard.numel()
        _check_flat(output, shard, size * dist.get_world_size())
        mine = output[dist.get_rank() * size :][:size]
        if mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard)
        for src in range(dist.get_world_size()):
            dist.broadcast(output[src * size :][:size], src=src)
        return
    # torch 2.13 renamed the flat collectives and warns on the old names, which are all that
    # torch 2.4-2.12 have.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, shard)


def reduce_scatter_flat_(flat: torch.Tensor) -> torch.Tensor:
    """This rank's slice (``flat`` split evenly over the ranks) of the sum over ranks of ``flat``.
    ``flat`` is scratch: its contents are undefined afterwards, and the result may view it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    size = flat.numel() // world
    if _is_gloo():
        _check_flat(flat, flat, size * world)
        # As for the all-gather: gloo's flat reduce-scatter stages through temporaries on its
        # own threads (about 64 MiB kept per rank for 8 MiB), while one in-place reduce per
        # destination rank needs none and took half the time (8.5 vs 16 ms).
        for dst in range(world):
            dist.reduce(flat[dst * size :][:size], dst=dst)
        return flat[rank * size :][:size]
    output = torch.empty(size, dtype=flat.dtype, device=flat.device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, flat)
    return output


def _check_flat(flat: torch.Tensor, part: torch.Tensor, numel: int) -> None:
    """What torch's flat collectives check (a mismatch would hang the ranks, not raise)."""
    if (
        flat.numel() != numel
        or flat.dtype != part.dtype
        or not (flat.is_contiguous() and part.is_contiguous())
    ):
        raise ValueError(
            f"flat collective: {flat.numel()} {flat.dtype} elements for {numel} {part.dtype} "
            "(both contiguous, the flat one world size x the shard)"
        )


def _is_gloo() -> bool:
    return dist.get_backend() == dist.Backend.GLOO
