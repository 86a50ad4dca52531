"""Predicted step time and peak memory of a plan, from saved profiles (ProTrain's cost model).

Pure functions over ``ModelProfile`` and ``HardwareProfile``; no torch, nothing of the runtime.

Time (one micro-batch; PAPERS.md "Cost models"), with chunks in execution order and the first
``n_persist`` of them persistent::

    step     = forward + max(backward + device_adam, host) + update   # the host worker overlaps backward
    host     = offloaded shards' CPU Adam + the adds of their reduced gradients into the fp32 shards

A window whose update needs the global gradient norm first (gradient clipping, fp16's overflow
check: ``updates_after_norm``) updates no chunk early; where host work overlaps compute it takes
the two-phase step, whose CPU Adam runs beside the next forward (each chunk's gather waiting for
its update) while the adds still run beside backward::

    step     = max(forward, cpu adam) + max(backward + device_adam, adds) + update
    device_adam = persistent shards' update (per element + per parameter segment)
                  + (world > 1) the all-gather refreshing their full copy
    update   = the gradient norm's read and the zeroing write over every trainable shard
    forward  = sum over chunks: persistent  fwd(c)
                                offloaded   max(fwd(c), fetch(c))   with a spare buffer to
                                            fwd(c) + fetch(c)       prefetch into, else serial
    backward = sum over chunks, in reverse: persistent       max(bwd(c), reduce(c))
                                            still in a buffer max(bwd(c), reduce(c) + offload(c))
                                            re-fetched        max(bwd(c), fetch(c) + reduce(c) + offload(c))
                                                              (serial: bwd(c) + fetch(c))
    fetch(c)  = shard bytes / host->device + (world > 1) all-gather of the chunk + latency
                + (compute dtype not fp32) the downcast of the fp32 shard into a staging buffer
    reduce(c) = (world > 1) reduce-scatter of the chunk's gradient + latency
    offload(c)= gradient shard bytes / device->host (into a staging buffer, in the compute dtype)
    add(c)    = the host worker's add of a staging buffer into the fp32 shard: reads the staged
                and fp32 bytes, writes fp32 (none with direct gradients: one rank in fp32 on CPU)

Where copies and collectives run on the compute cores (CPU: ``copies_overlap_compute`` False),
every max above becomes a sum, CPU Adam included (docs/decisions/0013-cpu-costs-add-up.md).

``fwd(c)``/``bwd(c)`` share each block's measured time among the chunks holding its parameters,
in proportion to parameter elements (time outside the blocks goes to parameters outside them,
or stays a constant when there are none). The last ``n_buffer`` offloaded chunks are still in a
buffer when forward ends and are reused by backward without a fetch.

Peak device memory (bytes per rank)::

    persistent chunks  full compute copy + fp32 master shard (shared with the copy for one rank
                       in fp32) + fp32 gradient shard + two fp32 Adam moments, the shards of
                       rank 0's real elements (no padding); frozen: the full copy alone (the
                       shard is a view of it)
    + n_buffer x chunk + saved activations + the transient peak + one chunk's gradient buffer
      (none when every gradient goes straight into a persistent fp32 shard): the peak falls where
      forward ends and backward starts, the loss's gradient (the transient) beside the buffer
      the first chunk's gradients fill (both counted by CUDA's allocator, and by the device
      wall on CPU)

Block modes other than keep (profiler/activation_cost.py) add their exposed transfer and
recompute time to forward and backward, replace the saved activations by their own peak, and add
swapped blocks to host memory.

Host memory (bytes per rank, exactly what the runtime maps: profiler/host_bytes.py, shared with
it): the offloaded chunks' real elements (rank 0's, the largest share: parameters are packed from
a chunk's start), fp32 master and two moments, plus an fp32 gradient shard when gradients are
kept (``keeps_gradients``: clipping, fp16, accumulation); frozen chunks in the compute dtype;
plus the fixed staging regions. Where gradients are applied as they arrive, the host worker
widens each to fp32 instead of adding it (none in fp32).
Every formula is O(1) per plan: per chunk size, ``chunk_costs`` builds prefix sums once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from protrain.profiler import host_bytes
from protrain.profiler.activation_cost import ActivationCost
from protrain.profiler.chunking import Packing, min_buffers_by_persist, pack, persistent_chunk_bytes
from protrain.profiler.profile import HardwareProfile, ModelProfile


@dataclass(frozen=True, slots=True)
class ChunkCosts:
    """Everything about one chunk size that the formulas need, as prefix sums over the chunks
    in execution order (index i holds the sum over chunks [0, i))."""

    chunk_size: int
    chunk_numel: int
    shard_numel: int
    num_chunks: int
    world_size: int
    element_size: int
    optimizer_states: int
    """fp32 state tensors per trainable element (the optimizer rule's; AdamW: 2)."""
    need: tuple[int, ...]
    """Fewest buffers for each n_persist in [0, num_chunks] (0 at num_chunks)."""
    fwd: tuple[float, ...]
    fwd_overlapped: tuple[float, ...]
    fwd_serial: tuple[float, ...]
    bwd_persistent: tuple[float, ...]
    bwd_reused: tuple[float, ...]
    bwd_fetched: tuple[float, ...]
    bwd_fetched_serial: tuple[float, ...]
    adam_params: tuple[float, ...]
    adam_segments: tuple[float, ...]
    host_adds: tuple[float, ...]
    """The host worker's add of each reduced gradient into an offloaded fp32 shard."""
    update_passes: tuple[float, ...]
    """The gradient norm's read and the zeroing write over each trainable shard on the device."""
    host_update_passes: tuple[float, ...]
    """The same over each trainable shard in host memory (offloaded, gradients kept)."""
    refresh: tuple[float, ...]
    """All-gather that refreshes a persistent chunk's full copy after its shard is updated."""
    host_widens: tuple[float, ...]
    """Gradients applied as they arrive: the host worker's widening of each to fp32."""
    persistent_bytes: tuple[int, ...]
    host_fp32_tensor_bytes: tuple[int, ...]
    """One fp32 state tensor of each trainable chunk's host shard (master, each moment, the
    gradient when kept: each takes this), were the chunk offloaded."""
    host_frozen_bytes: tuple[int, ...]
    """A frozen chunk's host shard, were it offloaded."""
    trainable_chunks: tuple[int, ...]
    unattributed_forward_s: float
    unattributed_backward_s: float
    direct_grads_possible: bool
    """One rank in fp32: persistent chunks' gradients need no chunk-sized buffer."""
    activation_bytes: int
    transient_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    step_s: float
    forward_s: float
    backward_s: float
    device_adam_s: float
    cpu_adam_s: float
    """The host worker's time: offloaded shards' CPU Adam and the adds of their gradients."""
    host_adds_s: float
    """Of ``cpu_adam_s``, the adds of reduced gradients into the fp32 shards, or where no
    gradient is kept their widening to fp32 (they run beside backward in every update mode)."""
    updates_after_norm: bool
    """The update waits for the global norm (clipping, fp16): the two-phase step's timing."""
    keeps_gradients: bool = True
    """Offloaded chunks keep an fp32 gradient shard on the host (16 bytes per parameter, not
    12)."""
    peak_device_bytes: int
    host_bytes: int
    persistent_bytes: int
    buffer_bytes: int
    gradient_buffer_bytes: int
    activation_bytes: int
    transient_bytes: int
    ssd_bytes: int = 0
    update_s: float = 0.0
    """The norm and zeroing passes after the optimizer."""
    workspace_bytes: int = 0
    """The math libraries' device workspaces (HardwareProfile.library_workspace_bytes)."""


def chunk_costs(
    model: ModelProfile, hardware: HardwareProfile, chunk_size: int, *, optimizer_states: int = host_bytes.ADAMW_STATES
) -> ChunkCosts:
    """Pack the parameters at ``chunk_size`` bytes and precompute the per-chunk terms."""
    e = model.element_size
    world = hardware.world_size
    packing = pack(model.param_sizes, max(1, chunk_size // e), world)
    fwd_c, bwd_c, rest_f, rest_b = _compute_per_chunk(model, packing)
    chunk_numel = packing.chunk_numel
    shard = chunk_numel // world
    chunk_bytes = chunk_numel * e
    latency = hardware.collective_latency_s if world > 1 else 0.0
    gather = chunk_bytes / hardware.all_gather_bytes_per_s + latency if world > 1 else 0.0
    scatter = chunk_bytes / hardware.reduce_scatter_bytes_per_s + latency if world > 1 else 0.0
    copy_rate, downcast_rate, add_rate = hardware.host_rates()
    # fp32 masters are downcast into a staging buffer before upload (runtime/chunks/staging.py),
    # on the host worker.
    downcast = shard * (4 + e) / downcast_rate if e != 4 else 0.0
    fetch = shard * e / hardware.h2d_bytes_per_s + gather + downcast
    offload = shard * e / hardware.d2h_bytes_per_s
    alias = world == 1 and e == 4
    overlap = hardware.copies_overlap_compute
    # On CPU one rank in fp32 accumulates straight into host shards: nothing to add.
    add = 0.0 if alias and not overlap else shard * (e + 8) / add_rate
    widen = shard * (e + 4) / downcast_rate if e != 4 else 0.0
    rows: dict[str, list[float]] = {name: [] for name in _PREFIXED}
    for index, chunk in enumerate(packing.chunks):
        f, b = fwd_c[index], bwd_c[index]
        reduce = scatter if chunk.trainable else 0.0
        off = offload if chunk.trainable else 0.0
        rows["fwd"].append(f)
        rows["fwd_serial"].append(f + fetch)
        if overlap:
            rows["fwd_overlapped"].append(max(f, fetch))
            rows["bwd_persistent"].append(max(b, reduce))
            rows["bwd_reused"].append(max(b, reduce + off))
            rows["bwd_fetched"].append(max(b, fetch + reduce + off))
            rows["bwd_fetched_serial"].append(max(b + fetch, reduce + off))
        else:  # the same cores do both: nothing hides
            rows["fwd_overlapped"].append(f + fetch)
            rows["bwd_persistent"].append(b + reduce)
            rows["bwd_reused"].append(b + reduce + off)
            rows["bwd_fetched"].append(b + fetch + reduce + off)
            rows["bwd_fetched_serial"].append(b + fetch + reduce + off)
        rows["adam_params"].append(chunk.used / world if chunk.trainable else 0.0)
        rows["adam_segments"].append(float(len(chunk.members)) if chunk.trainable else 0.0)
        rows["host_adds"].append(add if chunk.trainable else 0.0)
        rows["host_widens"].append(widen if chunk.trainable else 0.0)
        stored = host_bytes.rank_numel(chunk.used, shard, 0)  # rank 0 holds the most
        rows["trainable_chunks"].append(1 if chunk.trainable else 0)
        rows["update_passes"].append(2 * 4 * shard / hardware.memory_bytes_per_s if chunk.trainable else 0.0)
        rows["host_update_passes"].append(2 * 4 * shard / copy_rate if chunk.trainable else 0.0)
        rows["refresh"].append(gather if chunk.trainable else 0.0)
        persistent = persistent_chunk_bytes(
            chunk, chunk_numel=chunk_numel, world_size=world, element_size=e, optimizer_states=optimizer_states
        )
        rows["persistent_bytes"].append(persistent)
        if chunk.trainable:
            rows["host_fp32_tensor_bytes"].append(host_bytes.tensor_bytes(stored, 4))
            rows["host_frozen_bytes"].append(0)
        else:
            rows["host_fp32_tensor_bytes"].append(0)
            rows["host_frozen_bytes"].append(host_bytes.tensor_bytes(stored, e))
    need = min_buffers_by_persist(packing, model.module_params)
    prefixed = {name: tuple(accumulate(values, initial=0)) for name, values in rows.items()}
    return ChunkCosts(
        chunk_size=chunk_size,
        chunk_numel=chunk_numel,
        shard_numel=shard,
        num_chunks=packing.num_chunks,
        world_size=world,
        element_size=e,
        optimizer_states=optimizer_states,
        need=need,
        unattributed_forward_s=rest_f,
        unattributed_backward_s=rest_b,
        direct_grads_possible=alias,
        activation_bytes=model.activation_bytes,
        transient_bytes=model.transient_bytes,
        **{k: tuple(int(v) for v in vs) if k.endswith(("bytes", "chunks")) else vs for k, vs in prefixed.items()},  # type: ignore[arg-type]
    )


_PREFIXED = (
    "fwd",
    "fwd_overlapped",
    "fwd_serial",
    "bwd_persistent",
    "bwd_reused",
    "bwd_fetched",
    "bwd_fetched_serial",
    "adam_params",
    "adam_segments",
    "host_adds",
    "host_widens",
    "update_passes",
    "host_update_passes",
    "refresh",
    "persistent_bytes",
    "host_fp32_tensor_bytes",
    "host_frozen_bytes",
    "trainable_chunks",
)


def _compute_per_chunk(model: ModelProfile, packing: Packing) -> tuple[list[float], list[float], float, float]:
    """Forward and backward seconds per chunk; plus time no parameter can carry."""
    block_numel = [0] * len(model.blocks)
    other_numel = 0
    for (numel, _), block in zip(model.param_sizes, model.param_block, strict=True):
        if block >= 0:
            block_numel[block] += numel
        else:
            other_numel += numel
    fwd = [0.0] * packing.num_chunks
    bwd = [0.0] * packing.num_chunks
    for index, (numel, _) in enumerate(model.param_sizes):
        chunk = packing.placement[index][0]
        block = model.param_block[index]
        if block >= 0:
            share = numel / block_numel[block]
            fwd[chunk] += model.blocks[block].forward_s * share
            bwd[chunk] += model.blocks[block].backward_s * share
        else:
            fwd[chunk] += model.other_forward_s * numel / other_numel
            bwd[chunk] += model.other_backward_s * numel / other_numel
    rest_f = sum(b.forward_s for b, n in zip(model.blocks, block_numel, strict=True) if n == 0)
    rest_b = sum(b.backward_s for b, n in zip(model.blocks, block_numel, strict=True) if n == 0)
    if other_numel == 0:
        rest_f += model.other_forward_s
        rest_b += model.other_backward_s
    return fwd, bwd, rest_f, rest_b


def _span(prefix: Sequence[float], start: int, stop: int) -> float:
    return prefix[stop] - prefix[start]


def predict(
    model: ModelProfile,
    hardware: HardwareProfile,
    costs: ChunkCosts,
    *,
    n_persist: int,
    n_buffer: int,
    activations: ActivationCost | None = None,
    updates_after_norm: bool = False,
    keeps_gradients: bool = True,
) -> Prediction:
    """Step time and memory of the plan (``costs.chunk_size``, ``n_persist``, ``n_buffer``), with
    the block modes' ``activations`` cost (profiler.activation_cost; None: every block keeps).
    ``updates_after_norm``: clipping or fp16; ``keeps_gradients``: offloaded chunks keep a
    gradient shard (clipping, fp16, accumulation; see the module docstring)."""
    n = costs.num_chunks
    p = n_persist
    if not 0 <= p <= n:
        raise ValueError(f"n_persist={p} is outside [0, {n}]")
    if p < n and n_buffer < costs.need[p]:
        raise ValueError(f"n_buffer={n_buffer} is below the {costs.need[p]} buffers n_persist={p} needs")
    prefetch = n_buffer >= 2
    reused = min(n_buffer, n - p)
    forward = _span(costs.fwd, 0, p) + _span(costs.fwd_overlapped if prefetch else costs.fwd_serial, p, n)
    fetched = costs.bwd_fetched if prefetch else costs.bwd_fetched_serial
    backward = (
        _span(costs.bwd_persistent, 0, p) + _span(fetched, p, n - reused) + _span(costs.bwd_reused, n - reused, n)
    )
    forward += costs.unattributed_forward_s
    backward += costs.unattributed_backward_s
    activation_bytes = costs.activation_bytes
    segment = hardware.adam_segment_s
    device_rate, host_rate = hardware.device_adam_params_per_s, hardware.cpu_adam_params_per_s
    if not hardware.copies_overlap_compute:
        # One memory and one set of cores (CPU): the same kernel on the same state at either
        # place. Two measurements of it differ by noise alone, and a host rate above the
        # device's would make offloading look faster than keeping chunks, which it never is.
        device_rate = host_rate = min(device_rate, host_rate)
    device_adam = _span(costs.adam_params, 0, p) / device_rate
    device_adam += _span(costs.adam_segments, 0, p) * segment + _span(costs.refresh, 0, p)
    cpu_adam = _span(costs.adam_params, p, n) / host_rate
    cpu_adam += _span(costs.adam_segments, p, n) * segment
    host_adds = _span(costs.host_adds if keeps_gradients else costs.host_widens, p, n)
    cpu_adam += host_adds  # the same host worker, in order
    # Gradients applied as they arrive leave no offloaded shard to take a norm of or zero.
    update = _span(costs.update_passes, 0, p) + (_span(costs.host_update_passes, p, n) if keeps_gradients else 0.0)
    times = _Times(forward, backward, device_adam, cpu_adam, host_adds, update)
    step = _step_s(hardware, times, after_norm=updates_after_norm)

    chunk_bytes = costs.chunk_numel * costs.element_size
    persistent = int(_span(costs.persistent_bytes, 0, p))
    buffers = (n_buffer if p < n else 0) * chunk_bytes
    direct = costs.direct_grads_possible and p == n
    gradient_buffers = 0 if direct else chunk_bytes
    host = offloaded_host_bytes(costs, p, keeps_gradients=keeps_gradients)
    # The peak falls where forward ends and backward starts: every saved activation is alive,
    # with backward's first temporaries (the loss's gradient: the profile's transient, measured
    # beyond the activations and gradients) while the first chunk's gradient buffer fills.
    # The math libraries' workspaces stay allocated beside all of it (runtime/hw/math_workspaces.py).
    peak = persistent + buffers + activation_bytes + costs.transient_bytes + gradient_buffers
    peak += hardware.library_workspace_bytes
    kept = Prediction(
        step_s=step,
        forward_s=forward,
        backward_s=backward,
        device_adam_s=device_adam,
        cpu_adam_s=cpu_adam,
        host_adds_s=host_adds,
        updates_after_norm=updates_after_norm,
        keeps_gradients=keeps_gradients,
        peak_device_bytes=peak,
        host_bytes=host,
        persistent_bytes=persistent,
        buffer_bytes=buffers,
        gradient_buffer_bytes=gradient_buffers,
        activation_bytes=activation_bytes,
        transient_bytes=costs.transient_bytes,
        update_s=update,
        workspace_bytes=hardware.library_workspace_bytes,
    )
    return kept if activations is None else with_activations(kept, activations, hardware)


def offloaded_host_bytes(costs: ChunkCosts, n_persist: int, *, keeps_gradients: bool) -> int:
    """What chunks [n_persist, n) take in host memory on rank 0: their state's region and the
    staging regions (profiler/host_bytes.py, the runtime's own sizes)."""
    n = costs.num_chunks
    if n_persist >= n:
        return 0
    tensors = 1 + costs.optimizer_states + (1 if keeps_gradients else 0)
    payload = tensors * int(_span(costs.host_fp32_tensor_bytes, n_persist, n))
    payload += int(_span(costs.host_frozen_bytes, n_persist, n))
    return host_bytes.region_bytes(payload) + host_bytes.staging_bytes(
        costs.shard_numel,
        element_size=costs.element_size,
        offloaded_trainable=_span(costs.trainable_chunks, n_persist, n) > 0,
        keeps_gradients=keeps_gradients,
    )


def memory_with_activations(kept: Prediction, activations: ActivationCost) -> tuple[int, int]:
    """(peak device bytes, host bytes) of the chunk plan of ``kept`` with the block modes'
    ``activations`` instead of keeping every block: their peak replaces the kept activations,
    swapped bytes join host memory. What the search checks a layout's fit with, cheaply."""
    return (
        kept.peak_device_bytes - kept.activation_bytes + activations.peak_bytes,
        kept.host_bytes + activations.host_bytes,
    )


def with_activations(kept: Prediction, activations: ActivationCost, hardware: HardwareProfile) -> Prediction:
    """The prediction of the same chunk plan with the block modes' ``activations`` cost instead of
    keeping every block: their extra time joins forward and backward, their peak replaces the
    kept activations, swapped bytes join host memory. The search derives every layout of a chunk
    plan from one ``kept`` prediction this way."""
    forward = kept.forward_s + activations.forward_extra_s
    backward = kept.backward_s + activations.backward_extra_s
    peak, host = memory_with_activations(kept, activations)
    return dataclasses.replace(
        kept,
        step_s=_step_s(
            hardware,
            _Times(forward, backward, kept.device_adam_s, kept.cpu_adam_s, kept.host_adds_s, kept.update_s),
            after_norm=kept.updates_after_norm,
        ),
        forward_s=forward,
        backward_s=backward,
        peak_device_bytes=peak,
        host_bytes=host,
        activation_bytes=activations.peak_bytes,
        ssd_bytes=activations.ssd_bytes,
    )


@dataclass(frozen=True, slots=True)
class _Times:
    forward: float
    backward: float
    device_adam: float
    host: float
    """CPU Adam and the adds (the host worker's whole time)."""
    adds: float
    update: float


def _step_s(hardware: HardwareProfile, t: _Times, *, after_norm: bool) -> float:
    if not hardware.copies_overlap_compute:
        # The host worker takes cores compute would use (and a window that needs the norm
        # defers its updates to the step there: the same sum).
        return t.forward + t.backward + t.device_adam + t.host + t.update
    if after_norm:
        # Two-phase: CPU Adam beside the next forward, the adds beside backward.
        return max(t.forward, t.host - t.adds) + max(t.backward + t.device_adam, t.adds) + t.update
    return t.forward + max(t.backward + t.device_adam, t.host) + t.update
