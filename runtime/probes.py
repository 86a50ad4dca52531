"""Measurements for the planner: the machine (copy rates, Adam throughput, collectives) and the
model (per block forward time and saved bytes, backward time, the transient peak), returned as
the profiler's plain values.

The model is profiled on a batch either before it is chunked, its parameters where the caller
put them (the model fits the device), or through the chunk engine (``ChunkedRun``: chunks
gathered as training gathers them, the time compute waits for them taken off the clock), which
is how a model whose state does not fit the device is profiled. Backward time per block is the
measured backward total shared in proportion to forward time (per block backward hooks would
wrap every block's outputs).

Every rank must plan alike, so ``agree_*`` reduce measurements across ranks: the longest times,
the most bytes, the slowest rates. Hardware profiles are cached per machine under
``profiler.cache_dir``; ranks use the cache only if every rank has it, since measuring the
collectives takes all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from profiler.instruments import OUTSIDE, BlockTimer, PeakSampler, SavedBytes
from profiler.profile import BlockProfile, HardwareProfile, ModelProfile, cache_key
from runtime.activations.ssd_store import measure_disk_rates
from runtime.chunks.layout import ParamInfo
from runtime.cpu_adam import ShardAdamW
from runtime.device import DeviceInfo, device_allocated_bytes, release_free_memory, synchronize
from runtime.distributed import (
    DistContext,
    all_gather_flat,
    all_reduce_min_,
    all_reduce_sum_,
    reduce_scatter_flat_,
)

COPY_PROBE_BYTES = 32 << 20
ADAM_PROBE_NUMEL = 4 << 20
ADAM_PROBE_SEGMENTS = 64
COLLECTIVE_PROBE_BYTES = 8 << 20
DISK_PROBE_BYTES = 64 << 20
STEADY_STEPS = 0.05
"""Profiling steps stop once one's wall time is within this fraction of the one before."""
T = TypeVar("T")
REFRESH_ENV = "PROTRAIN_REFRESH_PROFILE"
"""Set to 1 to measure the hardware again instead of using the cached profile."""


# ---------------------------------------------------------------------------------- hardware


def hardware_profile(
    device: DeviceInfo,
    dist_ctx: DistContext | None,
    *,
    world_size: int,
    cache_dir: Path,
    origin: ProfileOrigin | None = None,
) -> HardwareProfile:
    """The cached profile of this machine at this world size (its entry noted in ``origin``),
    or a fresh measurement (cached).

    ``dist_ctx`` None (a dry run: no process group) estimates the collectives from the copy
    rate unless a cached profile exists, and writes nothing."""
    path = cache_dir / f"hardware-{hardware_key(device, world_size)}.json"
    cached = read_agreed(path, HardwareProfile.from_dict, dist_ctx)
    if cached is not None:
        if origin is not None:
            origin.cached.append(path)
        return cached
    profile = measure_hardware(device, dist_ctx, world_size=world_size)
    release_free_memory(device)  # the probes' buffers, freed but still resident
    if dist_ctx is not None:
        profile = agree_hardware(profile, dist_ctx)
        write_cached(path, profile.to_dict())
    return profile


def read_agreed(path: Path, parse: Callable[[dict[str, Any]], T], dist_ctx: DistContext | None) -> T | None:
    """The cached value at ``path`` if every rank has one (measuring takes all ranks, so either
    all use the cache or none does); ``PROTRAIN_REFRESH_PROFILE=1`` ignores caches."""
    cached: T | None = None
    if os.environ.get(REFRESH_ENV) != "1":
        try:
            cached = parse(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            cached = None
    have = torch.tensor([1.0 if cached is not None else 0.0], dtype=torch.float64)
    if dist_ctx is not None:
        all_reduce_min_(have, dist_ctx)
    return cached if have.item() > 0 else None


def write_cached(path: Path, body: dict[str, Any]) -> None:
    """Write atomically (ranks or jobs writing at once leave one whole file); a cache that
    cannot be written is only a cache."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        # Per process and thread: two engines of one process may profile from two threads.
        temporary = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
        temporary.write_text(json.dumps(body, indent=1))
        temporary.replace(path)


@dataclasses.dataclass(slots=True)
class ProfileOrigin:
    """The profile cache entries the plan in force was made from; empty when every profile was
    measured in this run. Each profiling starts it over. The engine drops these entries when the
    measured step time says they are stale (``runtime.plan_check``): the next launch measures."""

    cached: list[Path] = dataclasses.field(default_factory=list)

    def drop(self) -> list[Path]:
        """Remove the cached entries; those now gone (another rank on the host may have removed
        one first). An entry that cannot be removed stays, and is left out."""
        gone = []
        for path in self.cached:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
                gone.append(path)
        return gone


def measure_hardware(device: DeviceInfo, dist_ctx: DistContext | None, *, world_size: int) -> HardwareProfile:
    h2d, d2h = _copy_rates(device)
    cpu_adam, cpu_segment = _in_thread(lambda: _adam_rate(torch.device("cpu"), threads=1))
    device_adam, device_segment = _adam_rate(device.device, threads=None)
    if world_size == 1:
        gather = scatter = float("inf")
        latency = 0.0
    elif dist_ctx is None:
        # A dry run has no process group: loopback collectives move each byte through a socket
        # at about a quarter of the copy rate here (measured: gloo 64 MiB all-gather ~140 ms).
        gather = scatter = h2d / 4
        latency = 1e-4
    else:
        gather, scatter, latency = _collective_rates(device, dist_ctx)
    return HardwareProfile(
        device_kind=_device_kind(device),
        world_size=world_size,
        h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=d2h,
        cpu_adam_params_per_s=cpu_adam,
        device_adam_params_per_s=device_adam,
        all_gather_bytes_per_s=gather,
        reduce_scatter_bytes_per_s=scatter,
        collective_latency_s=latency,
        adam_segment_s=max(cpu_segment, device_segment),
        memory_bytes_per_s=_memory_rate(device),
        copies_overlap_compute=device.is_cuda,
    )


def agree_hardware(profile: HardwareProfile, dist_ctx: DistContext) -> HardwareProfile:
    """The slowest rate and the longest time of any rank, for every measured number: ranks
    that planned from different figures could pick different plans and then wait on each other
    in different collectives."""
    body = profile.to_dict()
    measured = [name for name, value in body.items() if isinstance(value, float)]
    # Rates (".._per_s") agree on the minimum, times on the maximum: min of the negatives.
    signs = [1.0 if name.endswith("_per_s") else -1.0 for name in measured]
    values = torch.tensor(
        [sign * body[name] for sign, name in zip(signs, measured, strict=True)], dtype=torch.float64
    )
    all_reduce_min_(values, dist_ctx)
    agreed = {name: sign * value for sign, name, value in zip(signs, measured, values.tolist(), strict=True)}
    return HardwareProfile.from_dict({**body, **agreed})


def _copy_rates(device: DeviceInfo) -> tuple[float, float]:
    numel = COPY_PROBE_BYTES // 4
    host = torch.empty(numel, dtype=torch.float32, pin_memory=device.is_cuda)
    host.fill_(1.0)
    on_device = torch.empty(numel, dtype=torch.float32, device=device.device)

    def h2d() -> None:
        on_device.copy_(host, non_blocking=device.is_cuda)

    def d2h() -> None:
        host.copy_(on_device, non_blocking=device.is_cuda)

    return COPY_PROBE_BYTES / _best_time(h2d, device), COPY_PROBE_BYTES / _best_time(d2h, device)


def _adam_rate(where: torch.device, *, threads: int | None) -> tuple[float, float]:
    """(parameters per second, seconds per parameter segment) of ShardAdamW: one shard as one
    segment, then as many (a chunk holds weights and biases), so the per-tensor cost shows."""
    if threads is not None:
        torch.set_num_threads(threads)
    info = DeviceInfo(where, "nccl" if where.type == "cuda" else "gloo")
    master = torch.zeros(ADAM_PROBE_NUMEL, dtype=torch.float32, device=where)
    grad = torch.full_like(master, 1e-3)
    whole = ShardAdamW(master, [(0, ADAM_PROBE_NUMEL, 0.1)], lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    one_segment = _best_time(lambda: whole.step_(grad, [True]), info)
    size = ADAM_PROBE_NUMEL // ADAM_PROBE_SEGMENTS
    segments = [(i * size, size, 0.1) for i in range(ADAM_PROBE_SEGMENTS)]
    split = ShardAdamW(master, segments, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    many = _best_time(lambda: split.step_(grad, [True] * ADAM_PROBE_SEGMENTS), info)
    per_segment = max(0.0, many - one_segment) / (ADAM_PROBE_SEGMENTS - 1)
    return ADAM_PROBE_NUMEL / one_segment, per_segment


def _collective_rates(device: DeviceInfo, dist_ctx: DistContext) -> tuple[float, float, float]:
    world = dist_ctx.world_size
    numel = COLLECTIVE_PROBE_BYTES // 4 // world * world
    dtype = torch.float32
    full = torch.zeros(numel, dtype=dtype, device=device.device)
    shard = torch.ones(numel // world, dtype=dtype, device=device.device)
    tiny = torch.zeros(1, dtype=dtype, device=device.device)
    gather_s = _best_time(lambda: all_gather_flat(full, shard, dist_ctx.group), device)
    scatter_s = _best_time(lambda: reduce_scatter_flat_(full, dist_ctx.group), device)
    latency = _best_time(lambda: all_reduce_sum_(tiny, dist_ctx), device)
    size = numel * 4
    return size / max(gather_s - latency, 1e-9), size / max(scatter_s - latency, 1e-9), latency


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


def _memory_rate(device: DeviceInfo) -> float:
    """Copy rate within the device tier (bytes copied per second)."""
    numel = COPY_PROBE_BYTES // 4
    source = torch.ones(numel, dtype=torch.float32, device=device.device)
    target = torch.empty_like(source)
    return COPY_PROBE_BYTES / _best_time(lambda: target.copy_(source), device)


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


def with_disk_rates(
    hardware: HardwareProfile,
    directory: Path,
    dist_ctx: DistContext | None,
    *,
    nbytes: int = DISK_PROBE_BYTES,
) -> HardwareProfile:
    """``hardware`` with the read and write rates of the filesystem under ``directory``, the
    slowest of any rank's (measured each start, not cached: the drive's load and its filesystem
    change between jobs)."""
    write_bps, read_bps, _ = measure_disk_rates(directory, nbytes=nbytes)
    rates = torch.tensor([write_bps, read_bps], dtype=torch.float64)
    if dist_ctx is not None:
        all_reduce_min_(rates, dist_ctx)
    return dataclasses.replace(
        hardware, ssd_write_bytes_per_s=float(rates[0]), ssd_read_bytes_per_s=float(rates[1])
    )


def hardware_key(device: DeviceInfo, world_size: int) -> str:
    return cache_key(
        _device_kind(device), world_size, platform.node(), torch.__version__, torch.get_num_threads()
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkedRun:
    """The chunk engine's side of a profiling step run through it (see
    ``ChunkManager.profiling``): gradients are dropped there, not by the profiler."""

    pack: Callable[[torch.Tensor], Any]
    """A saved tensor's stand-in: a recipe for a view of a chunk buffer slot, else the tensor."""
    unpack: Callable[[Any], torch.Tensor]
    model_state: Callable[[], set[int]]
    """Storage addresses of chunk memory: saved there, a tensor is model state, not activation."""
    stall_s: Callable[[], float]
    """Seconds compute has waited for chunks so far: off the profiler's clock."""
    end_forward: Callable[[], None]
    """The forward (and loss) is over: chunks it pinned may be evicted in backward."""
    end_step: Callable[[], None]
    """The step is over: wait for the side stream (the main thread issues collectives next)."""


def profile_model(
    model: nn.Module,
    run_forward: Callable[[], Any],
    *,
    loss_fn: Callable[[Any], torch.Tensor],
    params: tuple[ParamInfo, ...],
    blocks: list[nn.Module],
    block_path: str,
    module_params: list[list[int]],
    batch_shape: tuple[int, ...],
    precision: str,
    element_size: int,
    device: DeviceInfo,
    warmup_steps: int,
    profile_steps: int,
    chunked: ChunkedRun | None = None,
    agree_max: Callable[[float], float] = lambda seconds: seconds,
) -> ModelProfile:
    """Forward, loss and backward on the example batch, ``warmup_steps`` uninstrumented then
    up to ``profile_steps`` instrumented (the fastest kept). Measuring stops early once a step's
    wall time is within ``STEADY_STEPS`` of the step before it: the figures have settled, and
    each further step only adds to what profiling costs (a step of training, every one).
    Gradients are cleared afterwards and the random number generators restored, so training
    sees the model exactly as before (module buffers, e.g. running statistics, included).
    ``chunked``: the steps run through the chunk engine (which drops their gradients).
    ``agree_max(seconds)``: the largest of every rank's figure, so that all ranks stop after
    the same step (their steps issue collectives under the chunk engine)."""
    devices = [device.device.index or 0] if device.is_cuda else []
    runs: list[dict[str, Any]] = []
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    with torch.random.fork_rng(devices=devices):
        previous_s: float | None = None
        for _ in range(warmup_steps):
            started = time.perf_counter()
            _one_step(model, run_forward, loss_fn, blocks, device, instruments=False, chunked=chunked)
            previous_s = agree_max(time.perf_counter() - started)
        for _ in range(max(1, profile_steps)):
            started = time.perf_counter()
            runs.append(
                _one_step(model, run_forward, loss_fn, blocks, device, instruments=True, chunked=chunked)
            )
            wall_s = agree_max(time.perf_counter() - started)
            if previous_s is not None and abs(wall_s - previous_s) <= STEADY_STEPS * wall_s:
                break
            previous_s = wall_s
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)
    if chunked is None:
        for param in model.parameters():
            param.grad = None
    fastest = min(runs, key=lambda run: run["forward_s"] + run["backward_s"])
    timer: BlockTimer = fastest["timer"]
    saved: SavedBytes = fastest["saved"]
    forward_total = max(timer.total_s, 1e-12)
    backward_per_forward = fastest["backward_s"] / forward_total
    param_block = _param_blocks(params, block_path, len(blocks))
    return ModelProfile(
        batch_shape=batch_shape,
        precision=precision,
        element_size=element_size,
        param_sizes=tuple((p.numel, p.trainable) for p in params),
        param_block=param_block,
        module_params=tuple(tuple(m) for m in module_params if m),
        blocks=tuple(
            BlockProfile(
                forward_s=timer.forward_s[i],
                backward_s=timer.forward_s[i] * backward_per_forward,
                activation_bytes=saved.per_block[i],
                input_bytes=fastest["input_bytes"][i],
            )
            for i in range(len(blocks))
        ),
        other_forward_s=timer.outside_s,
        other_backward_s=timer.outside_s * backward_per_forward,
        other_activation_bytes=saved.outside,
        transient_bytes=max(0, *(run["transient"] for run in runs)),
    )


def agree_model(profile: ModelProfile, dist_ctx: DistContext) -> ModelProfile:
    """The longest times and the most bytes of any rank, per block."""
    if dist_ctx.world_size == 1:
        return profile
    numbers = [
        profile.other_forward_s,
        profile.other_backward_s,
        profile.other_activation_bytes,
        profile.transient_bytes,
    ]
    for block in profile.blocks:
        numbers += [block.forward_s, block.backward_s, block.activation_bytes, block.input_bytes]
    values = -torch.tensor(numbers, dtype=torch.float64)
    all_reduce_min_(values, dist_ctx)  # min of negatives: the maximum
    most = (-values).tolist()
    body = profile.to_dict()
    body.update(
        other_forward_s=most[0],
        other_backward_s=most[1],
        other_activation_bytes=int(most[2]),
        transient_bytes=int(most[3]),
        blocks=[
            {"forward_s": f, "backward_s": b, "activation_bytes": int(a), "input_bytes": int(x)}
            for f, b, a, x in zip(most[4::4], most[5::4], most[6::4], most[7::4], strict=True)
        ],
    )
    return ModelProfile.from_dict(body)


def _one_step(
    model: nn.Module,
    run_forward: Callable[[], Any],
    loss_fn: Callable[[Any], torch.Tensor],
    blocks: list[nn.Module],
    device: DeviceInfo,
    *,
    instruments: bool,
    chunked: ChunkedRun | None,
) -> dict[str, Any]:
    """One forward, loss and backward; measured when ``instruments``. Under the chunk engine
    its saved-tensor recipes are kept (a view of a buffer slot must be re-gathered in backward)
    and its gradients are not the profiler's to clear (they may view the fp32 shards)."""
    if chunked is None:
        for param in model.parameters():
            param.grad = None
    pack_inner = chunked.pack if chunked is not None else _same
    unpack = chunked.unpack if chunked is not None else _same
    if not instruments:
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(pack_inner, unpack)
            if chunked is not None
            else contextlib.nullcontext()
        )
        with hooks:
            loss = loss_fn(run_forward())
        if chunked is not None:
            chunked.end_forward()
        loss.backward()
        synchronize(device)
        if chunked is not None:
            chunked.end_step()
        return {}
    stall_s = chunked.stall_s if chunked is not None else lambda: 0.0

    def clock() -> float:
        synchronize(device)
        return time.perf_counter() - stall_s()

    timer = BlockTimer(clock, len(blocks))
    saved = SavedBytes(len(blocks), where=lambda: timer.current)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    if chunked is not None:
        param_storages |= chunked.model_state()
    grad_bytes = [0]
    peak = PeakSampler(lambda: device_allocated_bytes(device))

    def pack(tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages and storage.nbytes() > 0:
            saved.record((storage.data_ptr(), tensor.device), storage.nbytes())
        return pack_inner(tensor)

    def sample_forward(*_: Any) -> None:
        peak.sample(saved.total)

    def sample_backward(param: torch.Tensor) -> None:
        # Plain PyTorch keeps every gradient to the end; the chunk engine takes each one into
        # memory it already holds (counted in the base reading).
        if param.grad is not None and chunked is None:
            grad_bytes[0] += param.grad.numel() * param.grad.element_size()
        peak.sample(saved.total + grad_bytes[0])

    input_bytes = [0] * len(blocks)

    def enter_block(index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        timer.enter(index)
        # What a checkpointed block keeps: the tensors it is called with (one storage once).
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in (*args, *kwargs.values())
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in param_storages
        }
        input_bytes[index] = max(input_bytes[index], sum(storages.values()))

    handles = []
    for index, block in enumerate(blocks):
        handles.append(
            block.register_forward_pre_hook(
                lambda _, args, kwargs, i=index: enter_block(i, args, kwargs), with_kwargs=True
            )
        )
        handles.append(block.register_forward_hook(lambda *_, i=index: timer.exit(i)))
    for module in model.modules():
        handles.append(module.register_forward_hook(sample_forward))
    for param in model.parameters():
        if param.requires_grad:
            handles.append(param.register_post_accumulate_grad_hook(sample_backward))
    try:
        timer.start()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = loss_fn(run_forward())
        timer.stop()
        if chunked is not None:
            chunked.end_forward()
        started = clock()
        loss.backward()
        backward_s = clock() - started
        if chunked is not None:
            chunked.end_step()
    finally:
        for handle in handles:
            handle.remove()
    return {
        "timer": timer,
        "saved": saved,
        "forward_s": timer.total_s,
        "backward_s": backward_s,
        "transient": peak.peak_beyond,
        "input_bytes": input_bytes,
    }


def _same(value: Any) -> Any:
    return value


def _param_blocks(params: tuple[ParamInfo, ...], block_path: str, num_blocks: int) -> tuple[int, ...]:
    prefixes = [f"{block_path}.{i}." if block_path else f"{i}." for i in range(num_blocks)]
    owners = []
    for info in params:
        owner = OUTSIDE
        for name in (info.name, *info.aliases):
            for index, prefix in enumerate(prefixes):
                if name.startswith(prefix):
                    owner = index
                    break
            if owner != OUTSIDE:
                break
        owners.append(owner)
    return tuple(owners)
