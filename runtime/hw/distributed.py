"""Process group setup from the environment torch's launcher sets, and the few collectives the
engine issues. World size 1 runs the same code with the communication skipped."""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from protrain.runtime.hw import collective_counts


@dataclass(frozen=True, slots=True, kw_only=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    collective_device: torch.device
    """Where the backend's collectives run: host tensors are staged there for NCCL."""
    group: dist.ProcessGroup | None = None
    """This engine's own process group over every rank (None: the default group, or world size
    1). Two engines in one process each issue collectives from their own threads and in their
    own order; on one shared group the ranks could pair one engine's all-gather with the other's
    and hang, so each engine gets a group of its own (``new_group``) over the same ranks."""
    holds_default_group: bool = False
    """True when the default group is one ``initialize`` created (it stays for the next engine of
    the process and is destroyed at exit: see ``init_distributed``)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None or value == "" else int(value)


_created_default_group = False
"""Whether ``init_distributed`` created the default process group of this process."""


def init_distributed(
    *, backend: str, timeout_s: float, world_size: int, local_rank: int, collective_device: torch.device
) -> DistContext:
    """Join the process group torch's launcher described in the environment (init method
    ``env://``), or reuse one the caller (or an earlier engine) already made, and make this
    engine's own group over every rank; world size 1 needs none. Every rank must call it in the
    same order (``new_group`` is a collective).

    A default group created here stays when the engine closes, for the next engine of the
    process (train then evaluate, a sweep, Trainer after Trainer): a second
    ``init_process_group`` on the launcher's address would find the first one's store gone
    (gloo: "Connection refused") or wait for ranks that already left it. It is destroyed at exit."""
    global _created_default_group
    already = dist.is_available() and dist.is_initialized()
    if not already and world_size == 1:
        return DistContext(rank=0, world_size=1, local_rank=local_rank, collective_device=collective_device)
    timeout = timedelta(seconds=timeout_s)
    if not already:
        store = _attempt_store(world_size, timeout)
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend=backend, timeout=timeout, store=store, rank=env_int("RANK", 0), world_size=world_size
            )
        _created_default_group = True
        atexit.register(_destroy_default_group)
    holds_default = _created_default_group
    size = dist.get_world_size()
    group = None if size == 1 else dist.new_group(ranks=list(range(size)), timeout=timeout)
    return DistContext(
        rank=dist.get_rank(),
        world_size=size,
        local_rank=local_rank,
        collective_device=collective_device,
        group=group,
        holds_default_group=holds_default,
    )


def release(ctx: DistContext) -> None:
    """Leave the process group: destroy this engine's own group (the default group stays: see
    ``init_distributed``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if ctx.group is not None:
        dist.destroy_process_group(ctx.group)


def _destroy_default_group() -> None:
    """At exit: the default group ``init_distributed`` created goes (unless the caller did it)."""
    global _created_default_group
    if _created_default_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _created_default_group = False


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
    dist.broadcast_object_list(box, src=0, group=ctx.group if group is None else group)
    return box[0]


def _all_reduce_(tensor: torch.Tensor, ctx: DistContext, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    if ctx.world_size == 1:
        return tensor
    staged = tensor if tensor.device == ctx.collective_device else tensor.to(ctx.collective_device)
    collective_counts.count(ctx.group, "all_reduce", staged.numel() * staged.element_size())
    dist.all_reduce(staged, op=op, group=ctx.group)
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


def broadcast_from_main_(tensors: Iterable[torch.Tensor], ctx: DistContext) -> None:
    """Make every rank's ``tensors`` equal to rank 0's, in place (as DDP does at start), one at
    a time; a tensor away from the collective device (a host chunk under NCCL) is staged
    there, so the device holds one staged tensor at most."""
    if ctx.world_size == 1:
        return
    for tensor in tensors:
        data = tensor.detach()
        staged = data if data.device == ctx.collective_device else data.to(ctx.collective_device)
        collective_counts.count(ctx.group, "broadcast", staged.numel() * staged.element_size())
        dist.broadcast(staged, src=0, group=ctx.group)
        if staged is not data:
            data.copy_(staged)


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Every rank's ``shard`` concatenated into ``output`` (world size x shard elements), over
    ``group`` (an engine's own group over every rank; None: the default group)."""
    collective_counts.count(group, "all_gather", output.numel() * output.element_size())
    if _is_gloo(group):
        # gloo's flat all-gather stages through temporaries allocated on its own threads, which
        # glibc keeps as per-thread free memory; one broadcast per rank straight into its slice
        # needs none and is faster (docs/decisions/0007-gloo-collectives-by-broadcast-and-reduce.md).
        # The bytes each rank sends and receives are the same.
        size = shard.numel()
        _check_flat(output, shard, size * dist.get_world_size(group))
        rank = dist.get_rank(group)
        mine = output[rank * size :][:size]
        if mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard)
        if _exchanges_halves(output, group):
            # Two ranks: one send and one receive each way (a broadcast per rank costs more).
            other = 1 - rank
            _exchange(mine, output[other * size :][:size], other, group)
            return
        for src in range(dist.get_world_size(group)):
            dist.broadcast(output[src * size :][:size], src=src, group=group)
        return
    # torch 2.13 renamed the flat collectives and warns on the old names, which are all that
    # torch 2.4-2.12 have.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, shard, group=group)


def reduce_scatter_flat_(flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's slice (``flat`` split evenly over the ranks) of the sum over ranks of ``flat``.
    ``flat`` is scratch: its contents are undefined afterwards, and the result may view it."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    size = flat.numel() // world
    collective_counts.count(group, "reduce_scatter", flat.numel() * flat.element_size())
    if _is_gloo(group):
        _check_flat(flat, flat, size * world)
        if flat.is_cuda:
            return reduce_scatter_by_all_reduce_(flat, group)
        # As for the all-gather: gloo's flat reduce-scatter stages through temporaries on its
        # own threads, while one in-place reduce per destination rank needs none and is faster.
        for dst in range(world):
            dist.reduce(flat[dst * size :][:size], dst=dst, group=group)
        return flat[rank * size :][:size]
    output = torch.empty(size, dtype=flat.dtype, device=flat.device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, flat, group=group)
    return output


def reduce_scatter_into(out: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``reduce_scatter_flat_`` with the result written into ``out`` (this rank's part of
    ``flat``'s size, anywhere on the host for gloo over CPU tensors); returns ``out``.

    gloo, CPU tensors, two ranks: each rank sends the other's part of ``flat`` and receives its
    own part of the other's straight into ``out``, then adds its own: one exchange instead of a
    reduce per rank (half the time at 4 MiB: 2.4 vs 4.2 ms) and no copy afterwards. The sum of
    two addends is the same in either order, so the result is bit for bit the reduces'."""
    if not _exchanges_halves(flat, group):
        return out.copy_(reduce_scatter_flat_(flat, group))
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    size = out.numel()
    _check_flat(flat, out, size * world)
    collective_counts.count(group, "reduce_scatter", flat.numel() * flat.element_size())
    other = 1 - rank
    _exchange(flat[other * size :][:size], out, other, group)
    return out.add_(flat[rank * size :][:size])


def _exchanges_halves(flat: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """Whether the flat collectives run as one exchange between two gloo ranks (CPU tensors)."""
    return not flat.is_cuda and _is_gloo(group) and dist.get_world_size(group) == 2


def _exchange(send: torch.Tensor, receive: torch.Tensor, peer: int, group: dist.ProcessGroup | None) -> None:
    """``send`` to the group's rank ``peer`` while ``receive`` is filled from it."""
    peer_global = peer if group is None else dist.get_global_rank(group, peer)
    requests = [
        dist.isend(send, dst=peer_global, group=group),
        dist.irecv(receive, src=peer_global, group=group),
    ]
    for request in requests:
        assert request is not None, "this rank is in the group"  # None only for a rank outside it
        request.wait()


def all_reduce_flat_(flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``flat`` summed over the ranks, in place (a replicated chunk's gradients, as DDP's
    buckets); returns it."""
    collective_counts.count(group, "all_reduce", flat.numel() * flat.element_size())
    dist.all_reduce(flat, group=group)
    return flat


def reduce_scatter_by_all_reduce_(flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``reduce_scatter_flat_`` through one all-reduce of the whole of ``flat``: this rank's slice
    of the sum (a view of ``flat``, which is scratch).

    gloo over CUDA tensors: torch documents only broadcast and all-reduce for gloo on CUDA (its
    source has a staged CUDA reduce too, but that is not promised), and this path only serves
    several ranks sharing one GPU, where NCCL refuses (scripts/gpu_checks/two_ranks.py). Every
    rank receives the whole sum, twice the bytes of the reduces, which no real run pays: ranks
    on their own GPUs use NCCL's reduce-scatter. Two ranks' sums agree bit for bit either way."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    size = flat.numel() // world
    _check_flat(flat, flat, size * world)
    dist.all_reduce(flat, group=group)
    return flat[rank * size :][:size]


def _check_flat(flat: torch.Tensor, part: torch.Tensor, numel: int) -> None:
    """What torch's flat collectives check (a mismatch would hang the ranks, not raise)."""
    if flat.numel() != numel or flat.dtype != part.dtype or not (flat.is_contiguous() and part.is_contiguous()):
        raise ValueError(
            f"flat collective: {flat.numel()} {flat.dtype} elements for {numel} {part.dtype} "
            "(both contiguous, the flat one world size x the shard)"
        )


def _is_gloo(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == dist.Backend.GLOO
