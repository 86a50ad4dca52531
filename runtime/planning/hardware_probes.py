"""Hardware probes for the planner: copy rates between the tiers, CPU and device Adam
throughput, host arithmetic rates (``host_rates``), collective bandwidth and latency, and the
disk under the activation directory, returned as the profiler's plain ``HardwareProfile``.

Every rank must plan alike, so ``agree_hardware`` reduces the measurements across ranks: the
slowest rates, the longest times. Hardware profiles are cached per machine under
``profiler.cache_dir`` (``runtime.planning.profile_cache``). The model is measured by
``runtime.planning.model_profiling``.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from protrain.profiler.profile import HardwareProfile, cache_key
from protrain.runtime.config.settings import PlanningSettings
from protrain.runtime.hw import device_wall
from protrain.runtime.hw.device import (
    DeviceInfo,
    counts_every_byte,
    device_allocated_bytes,
    host_worker_threads,
    release_free_memory,
    synchronize,
)
from protrain.runtime.hw.distributed import (
    DistContext,
    all_gather_flat,
    all_reduce_flat_,
    all_reduce_min_,
    all_reduce_sum_,
    reduce_scatter_flat_,
)
from protrain.runtime.hw.nvml import describe_link, pcie_link
from protrain.runtime.hw.ssd_io import measure_disk_rates
from protrain.runtime.optim.registry import rule_named
from protrain.runtime.optim.rule import OptimizerHyper
from protrain.runtime.planning.host_rates import measure_host_rates
from protrain.runtime.planning.profile_cache import ProfileOrigin, read_agreed, write_cached

COPY_PROBE_BYTES = 32 << 20
ADAM_PROBE_NUMEL = 4 << 20
ADAM_PROBE_SEGMENTS = 64
COLLECTIVE_PROBE_BYTES = 8 << 20
DISK_PROBE_BYTES = 64 << 20
T = TypeVar("T")


def hardware_profile(
    device: DeviceInfo,
    dist_ctx: DistContext | None,
    *,
    world_size: int,
    cache_dir: Path,
    origin: ProfileOrigin | None = None,
    device_budget: int | None = None,
    optimizer: str = "adamw",
    momentum: float = 0.0,
) -> HardwareProfile:
    """The cached profile of this machine at this world size (its entry noted in ``origin``),
    or a fresh measurement (cached), whose device buffers stay within an eighth of
    ``device_budget`` (None: the probes' full sizes). The update rates are those of the
    ``optimizer`` rule (SGD's with ``momentum``), each rule's cached apart.

    ``dist_ctx`` None (a dry run: no process group) estimates the collectives from the copy
    rate unless a cached profile exists, and writes nothing."""
    probe = OptimizerProbe(optimizer, momentum)
    path = cache_dir / f"hardware-{hardware_key(device, world_size, probe)}.json"
    cached = read_agreed(path, HardwareProfile.from_dict, dist_ctx)
    if cached is not None:
        if origin is not None:
            origin.add(path)
        return cached
    profile = measure_hardware(device, dist_ctx, world_size=world_size, device_budget=device_budget, optimizer=probe)
    release_free_memory(device)  # the probes' buffers, freed but still resident
    if dist_ctx is not None:
        profile = agree_hardware(profile, dist_ctx)
        write_cached(path, profile.to_dict())
    return profile


def measure_hardware(
    device: DeviceInfo,
    dist_ctx: DistContext | None,
    *,
    world_size: int,
    device_budget: int | None = None,
    optimizer: OptimizerProbe | None = None,
) -> HardwareProfile:
    """Each probe's device buffers together take at most an eighth of what is left of
    ``device_budget``: the probes run inside the engine's budget, as everything it allocates
    does."""
    room = None if device_budget is None else max(64 << 10, _free(device, device_budget) // 8)
    if room is not None and dist_ctx is not None:  # the collective probe's size: every rank's the same
        room = int(all_reduce_min_(torch.tensor([float(room)], dtype=torch.float64), dist_ctx)[0])
    h2d, d2h = _copy_rates(device, _fit(COPY_PROBE_BYTES, room))
    # With the host worker's thread count: its rate is what the cost model's host term needs.
    threads = host_worker_threads(device)
    probe = optimizer or OptimizerProbe()
    adam_numel = _fit(ADAM_PROBE_NUMEL * 16, room) // 16  # master, gradient, two moments at most
    cpu_adam, cpu_segment = _in_thread(lambda: _update_rate(probe, torch.device("cpu"), adam_numel, threads=threads))
    device_adam, device_segment = _update_rate(probe, device.device, adam_numel, threads=None)
    host = measure_host_rates(threads)
    if world_size == 1:
        gather = scatter = reduce_all = float("inf")
        latency = 0.0
    elif dist_ctx is None:
        # A dry run has no process group: loopback collectives move each byte through a socket,
        # at about a quarter of the copy rate (docs/decisions/0008-dry-run-collective-rates.md);
        # an all-reduce moves it twice (a ring's reduce-scatter, then its all-gather).
        gather = scatter = h2d / 4
        reduce_all = h2d / 8
        latency = 1e-4
    else:
        gather, scatter, reduce_all, latency = _collective_rates(
            device, dist_ctx, _fit(COLLECTIVE_PROBE_BYTES, room) // 2
        )
    return HardwareProfile(
        device_kind=_device_kind(device),
        world_size=world_size,
        h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=d2h,
        cpu_adam_params_per_s=cpu_adam,
        device_adam_params_per_s=device_adam,
        all_gather_bytes_per_s=gather,
        all_reduce_bytes_per_s=reduce_all,
        reduce_scatter_bytes_per_s=scatter,
        collective_latency_s=latency,
        adam_segment_s=max(cpu_segment, device_segment),
        optimizer=probe.label,
        memory_bytes_per_s=_memory_rate(device, _fit(COPY_PROBE_BYTES, room) // 2),
        host_copy_bytes_per_s=host.copy_bytes_per_s,
        host_downcast_bytes_per_s=host.downcast_bytes_per_s,
        host_add_bytes_per_s=host.add_bytes_per_s,
        host_shared_factor=host.shared_factor,
        copies_overlap_compute=device.is_cuda,
        link=describe_link(pcie_link(device.device)) if device.is_cuda else "",
    )


def agree_hardware(profile: HardwareProfile, dist_ctx: DistContext) -> HardwareProfile:
    """The slowest rate and the longest time of any rank, for every measured number: ranks
    that planned from different figures could pick different plans and then wait on each other
    in different collectives."""
    body = profile.to_dict()
    measured = [name for name, value in body.items() if isinstance(value, float)]
    # Rates (".._per_s") agree on the minimum, times on the maximum: min of the negatives.
    signs = [1.0 if name.endswith("_per_s") else -1.0 for name in measured]
    values = torch.tensor([sign * body[name] for sign, name in zip(signs, measured, strict=True)], dtype=torch.float64)
    all_reduce_min_(values, dist_ctx)
    agreed = {name: sign * value for sign, name, value in zip(signs, measured, values.tolist(), strict=True)}
    return HardwareProfile.from_dict({**body, **agreed})


def _free(device: DeviceInfo, budget: int) -> int:
    """What is left of ``budget`` now, where the readings count every byte (CUDA; CPU under the
    device wall): an engine that profiles through its chunks holds them already."""
    return budget - device_allocated_bytes(device) if counts_every_byte(device) else budget


def _fit(nbytes: int, room: int | None) -> int:
    return nbytes if room is None else min(nbytes, room)


def _copy_rates(device: DeviceInfo, nbytes: int) -> tuple[float, float]:
    numel = nbytes // 4
    with device_wall.host_allocations():
        host = torch.empty(numel, dtype=torch.float32, pin_memory=device.is_cuda)
    host.fill_(1.0)
    on_device = torch.empty(numel, dtype=torch.float32, device=device.device)

    def h2d() -> None:
        on_device.copy_(host, non_blocking=device.is_cuda)

    def d2h() -> None:
        host.copy_(on_device, non_blocking=device.is_cuda)

    return nbytes / _best_time(h2d, device), nbytes / _best_time(d2h, device)


@dataclass(frozen=True, slots=True)
class OptimizerProbe:
    """The optimizer rule whose update the probes time (SGD's with or without momentum)."""

    name: str = "adamw"
    momentum: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.name}+momentum" if self.momentum else self.name

    def kernel(self, master: torch.Tensor, segments: list[tuple[int, int, float, int]]) -> Any:
        rule = rule_named(self.name).for_momentum(self.momentum)
        hyper = OptimizerHyper(
            weight_decay=(), group=(), lrs=(1e-3,), betas=((0.9, 0.95),), eps=1e-8, momentum=self.momentum
        )
        states = tuple(torch.zeros_like(master) for _ in rule.state_names)
        return rule.build(master, segments, hyper=hyper, states=states)


def _update_rate(probe: OptimizerProbe, where: torch.device, numel: int, *, threads: int | None) -> tuple[float, float]:
    """(parameters per second, seconds per parameter segment) of the rule's kernel: one shard as
    one segment, then as many (a chunk holds weights and biases), so the per-tensor cost shows."""
    if threads is not None:
        torch.set_num_threads(threads)
    info = DeviceInfo(where, "nccl" if where.type == "cuda" else "gloo")
    numel = max(numel, ADAM_PROBE_SEGMENTS * 64)
    master = torch.zeros(numel, dtype=torch.float32, device=where)
    grad = torch.full_like(master, 1e-3)
    whole = probe.kernel(master, [(0, numel, 0.1, 0)])
    one_segment = _best_time(lambda: whole.step_(grad, [True]), info)
    size = numel // ADAM_PROBE_SEGMENTS
    split = probe.kernel(master, [(i * size, size, 0.1, 0) for i in range(ADAM_PROBE_SEGMENTS)])
    many = _best_time(lambda: split.step_(grad, [True] * ADAM_PROBE_SEGMENTS), info)
    per_segment = max(0.0, many - one_segment) / (ADAM_PROBE_SEGMENTS - 1)
    return numel / one_segment, per_segment


def _collective_rates(device: DeviceInfo, dist_ctx: DistContext, nbytes: int) -> tuple[float, float, float, float]:
    """(all-gather, reduce-scatter, all-reduce) bytes per second of a chunk-sized collective as
    the engine issues them, and the latency of a tiny one. The all-reduce is measured, not
    derived from the other two: gloo's ring all-reduce and the engine's broadcast and reduce
    forms of the others differ (a replicated chunk's gradient goes by all-reduce)."""
    world = dist_ctx.world_size
    numel = max(world, nbytes // 4 // world * world)
    dtype = torch.float32
    full = torch.zeros(numel, dtype=dtype, device=device.device)
    shard = torch.ones(numel // world, dtype=dtype, device=device.device)
    tiny = torch.zeros(1, dtype=dtype, device=device.device)
    gather_s = _best_time(lambda: all_gather_flat(full, shard, dist_ctx.group), device)
    scatter_s = _best_time(lambda: reduce_scatter_flat_(full, dist_ctx.group), device)
    reduce_s = _best_time(lambda: all_reduce_flat_(full, dist_ctx.group), device)
    latency = _best_time(lambda: all_reduce_sum_(tiny, dist_ctx), device)
    size = numel * 4
    rates = (gather_s, scatter_s, reduce_s)
    gather, scatter, reduce_all = (size / max(seconds - latency, 1e-9) for seconds in rates)
    return gather, scatter, reduce_all, latency


def _best_time(work: Callable[[], Any], device: DeviceInfo, repeats: int = 3) -> float:
    work()  # warm-up: first-touch page faults, kernel selection, connections
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return max(best, 1e-9)


def _memory_rate(device: DeviceInfo, nbytes: int) -> float:
    """Copy rate within the device tier (bytes copied per second)."""
    numel = nbytes // 4
    source = torch.ones(numel, dtype=torch.float32, device=device.device)
    target = torch.empty_like(source)
    return numel * 4 / _best_time(lambda: target.copy_(source), device)


def _in_thread(work: Callable[[], T]) -> T:
    """Run ``work`` on a fresh thread (as the CPU-Adam thread runs), so its thread setting stays there."""
    result: list[T] = []
    thread = threading.Thread(target=lambda: result.append(work()), name="protrain-probe")
    thread.start()
    thread.join()
    return result[0]


def _device_kind(device: DeviceInfo) -> str:
    if device.is_cuda:
        return f"cuda:{torch.cuda.get_device_name(device.device)}"
    return f"cpu:{platform.processor() or platform.machine()}x{os.cpu_count()}"


def disk_inputs(settings: PlanningSettings, hardware: HardwareProfile) -> dict[str, Any]:
    """What the search takes of the disk under ``memory.ssd.path``: whether activations and
    optimizer state may go there (a path and its measured rates), the room it has for this rank
    (its free bytes shared by the host's ranks) and the NVMe tier's write limit."""
    available = hardware.ssd_write_bytes_per_s > 0 and settings.ssd_path is not None
    room = None
    if available and settings.ssd_path is not None and settings.ssd_path.exists():
        room = shutil.disk_usage(settings.ssd_path).free // max(1, hardware.ssd_ranks_sharing)
    return {"ssd_available": available, "disk_room": room, "max_writes_per_day": settings.max_nvme_writes_per_day}


def with_disk_rates(
    hardware: HardwareProfile,
    directory: Path,
    dist_ctx: DistContext | None,
    *,
    nbytes: int = DISK_PROBE_BYTES,
) -> HardwareProfile:
    """``hardware`` with the read and write rates of the filesystem under ``directory`` as one
    process sees them, measured by each host's first local rank alone (the others would share
    the drive during the probe), the slowest host's; the local ranks are the ranks sharing it
    (measured each start, not cached: the drive's load and its filesystem change between jobs)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    rates = torch.full((2,), float("inf"), dtype=torch.float64)
    if local_rank == 0 or dist_ctx is None:
        write_bps, read_bps, _ = measure_disk_rates(directory, nbytes=nbytes)
        rates = torch.tensor([write_bps, read_bps], dtype=torch.float64)
    if dist_ctx is not None:
        all_reduce_min_(rates, dist_ctx)
    return dataclasses.replace(
        hardware,
        ssd_write_bytes_per_s=float(rates[0]),
        ssd_read_bytes_per_s=float(rates[1]),
        ssd_ranks_sharing=max(1, sharing),
    )


def hardware_key(device: DeviceInfo, world_size: int, optimizer: OptimizerProbe | None = None) -> str:
    probe = optimizer or OptimizerProbe()
    parts: tuple[object, ...] = (_device_kind(device), world_size, platform.node(), torch.__version__)
    # AdamW's key is the one profiles were cached under before other rules were probed.
    extra = () if probe.label == "adamw" else (probe.label,)
    return cache_key(*parts, torch.get_num_threads(), *extra)
