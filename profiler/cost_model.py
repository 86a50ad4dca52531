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
                  + (world > 1) the all-gather refreshing their full copy, each on the side
                  stream right after its chunk's update: with k sharded chunks, updates U and
                  gathers G in all, max(U + G/k, U/k + G) (the last gather, or the first update,
                  is never hidden); a replicated chunk (the first ``n_replicate`` persistent
                  ones) updates the whole chunk on every rank and refreshes its copy from its
                  own master, no all-gather
    update   = the gradient norm's read and the zeroing write over every trainable shard (no
               zeroing where gradients accumulate in place: the next window's are copied over)
    forward  = sum over chunks: persistent  fwd(c)
                                offloaded   max(fwd(c), fetch(c))   with a spare buffer to
                                            fwd(c) + fetch(c)       prefetch into, else serial
    backward = sum over chunks, in reverse: persistent       max(bwd(c), reduce(c))
                                            still in a buffer max(bwd(c), reduce(c) + offload(c))
                                            re-fetched        max(bwd(c), fetch(c) + reduce(c) + offload(c))
                                                              (serial: bwd(c) + fetch(c))
    bwd(c)    = the chunk's share of the profiled backward + (gradients through a buffer) the
                buffer's zero-fill and each gradient's add into it at the device's memory rate,
                which profiling leaves out; none where gradients accumulate in place (fp32 on
                one rank, or a replicated chunk in fp32)
    fetch(c)  = shard bytes / host->device + (world > 1) all-gather of the chunk + latency
                + (compute dtype not fp32) the downcast of the fp32 shard into a staging buffer
    reduce(c) = (world > 1) reduce-scatter of the chunk's gradient + latency; replicated: one
                all-reduce (a ring's reduce-scatter and all-gather, one latency), as DDP's
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
                       shard is a view of it); replicated: as one rank's, the whole chunk
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

from protrain.profiler import host_bytes
from protrain.profiler.activation_cost import ActivationCost
from protrain.profiler.chunk_costs import ChunkCosts, chunk_costs
from protrain.profiler.profile import HardwareProfile, ModelProfile

__all__ = ["ChunkCosts", "Prediction", "chunk_costs", "memory_with_activations", "predict", "with_activations"]


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
    nvme_bytes: int = 0
    """Optimizer state on NVMe (``n_optimizer``), rank 0's: what each update writes there."""
    nvme_read_bytes: int = 0
    """What each update reads back from NVMe (the chunks that share a host slot)."""


def _refreshed(updates: float, gathers: float, chunks: int, *, overlap: bool) -> float:
    """Sharded persistent chunks' updates and their refresh all-gathers, each gather queued on
    the side stream after its chunk's update (runtime/chunks/residency.py ``refresh_early``)."""
    if not overlap or chunks <= 0:
        return updates + gathers
    return max(updates + gathers / chunks, updates / chunks + gathers)


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
    n_replicate: int = 0,
    n_optimizer: int = 0,
) -> Prediction:
    """Step time and memory of the plan (``costs.chunk_size``, ``n_persist``, ``n_buffer``,
    ``n_replicate`` of the persistent chunks replicated, the optimizer state of the last
    ``n_optimizer`` offloaded trainable chunks on NVMe), with the block modes' ``activations``
    cost (profiler.activation_cost; None: every block keeps). ``updates_after_norm``: clipping or
    fp16; ``keeps_gradients``: offloaded chunks keep a gradient shard (clipping, fp16,
    accumulation; see the module docstring)."""
    n = costs.num_chunks
    p, r = n_persist, n_replicate
    if not 0 <= p <= n:
        raise ValueError(f"n_persist={p} is outside [0, {n}]")
    if not 0 <= r <= p:
        raise ValueError(f"n_replicate={r} is outside [0, n_persist={p}]")
    nvme_from = nvme_start(costs, n_optimizer)
    if nvme_from < p:
        raise ValueError(f"n_optimizer={n_optimizer} exceeds the trainable chunks past n_persist={p}")
    if p < n and n_buffer < costs.need[p]:
        raise ValueError(f"n_buffer={n_buffer} is below the {costs.need[p]} buffers n_persist={p} needs")
    prefetch = n_buffer >= 2
    reused = min(n_buffer, n - p)
    forward = _span(costs.fwd, 0, p) + _span(costs.fwd_overlapped if prefetch else costs.fwd_serial, p, n)
    fetched = costs.bwd_fetched if prefetch else costs.bwd_fetched_serial
    backward = _span(costs.bwd_replicated, 0, r) + _span(costs.bwd_persistent, r, p)
    backward += _span(fetched, p, n - reused) + _span(costs.bwd_reused, n - reused, n)
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
    sharded_updates = _span(costs.adam_params, r, p) / device_rate + _span(costs.adam_segments, r, p) * segment
    device_adam = _span(costs.replicated_update, 0, r) + _span(costs.adam_segments, 0, r) * segment
    gathers = _span(costs.refresh, r, p)
    device_adam += _refreshed(sharded_updates, gathers, p - r, overlap=hardware.copies_overlap_compute)
    cpu_adam = _span(costs.adam_params, p, n) / host_rate
    cpu_adam += _span(costs.adam_segments, p, n) * segment
    host_adds = _span(costs.host_adds if keeps_gradients else costs.host_widens, p, n)
    cpu_adam += host_adds  # the same host worker, in order
    # Gradients applied as they arrive leave no offloaded shard to take a norm of or zero.
    update = _span(costs.update_passes, r, p) + (_span(costs.host_update_passes, p, n) if keeps_gradients else 0.0)
    read, written = nvme_io_bytes(costs, n_optimizer, keeps_gradients=keeps_gradients)
    if n_optimizer:
        # The I/O thread reads each NVMe chunk's state ahead of its update and writes it behind:
        # the host worker waits only for the first read and for I/O slower than the updates.
        write_rate, read_rate = hardware.ssd_rates()
        if read_rate > 0 and write_rate > 0:
            first = read / max(1, n_optimizer)
            cpu_adam = max(cpu_adam, read / read_rate + written / write_rate) + first / read_rate
    times = _Times(forward, backward, device_adam, cpu_adam, host_adds, update)
    step = _step_s(hardware, times, after_norm=updates_after_norm)

    chunk_bytes = costs.chunk_numel * costs.element_size
    persistent = int(_span(costs.replicated_bytes, 0, r) + _span(costs.persistent_bytes, r, p))
    buffers = (n_buffer if p < n else 0) * chunk_bytes
    direct = costs.direct_grads_possible and p == n
    gradient_buffers = 0 if direct else chunk_bytes
    host = offloaded_host_bytes(costs, p, keeps_gradients=keeps_gradients, n_optimizer=n_optimizer)
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
        nvme_bytes=written,
        nvme_read_bytes=read,
    )
    return kept if activations is None else with_activations(kept, activations, hardware)


def nvme_start(costs: ChunkCosts, n_optimizer: int) -> int:
    """The first chunk of the last ``n_optimizer`` trainable ones (``num_chunks`` for none; -1
    when there are fewer): those keep their optimizer state on NVMe, were they offloaded."""
    if n_optimizer < len(costs.nvme_starts):
        return costs.nvme_starts[max(0, n_optimizer)]
    return -1


def nvme_io_bytes(costs: ChunkCosts, n_optimizer: int, *, keeps_gradients: bool = False) -> tuple[int, int]:
    """(read, written) bytes of NVMe files per update on rank 0 (one micro-batch per window):
    every NVMe chunk's state is written back, read again only where the chunk shares its host
    slot with another (chunk i of the NVMe ones uses slot i mod min(3, n);
    runtime/chunks/nvme_state.py). Kept gradients are written once; the update reads them back
    but for the first two chunks it reaches, whose gradient buffers still hold them
    (runtime/chunks/nvme_grads.py; each further micro-batch of a window adds a read and a write)."""
    if n_optimizer <= 0:
        return 0, 0
    slots = min(host_bytes.NVME_SLOTS, n_optimizer)
    tensors = host_bytes.nvme_tensors(costs.optimizer_states, costs.element_size)
    sharing = [0] * slots
    per_chunk = []
    for position in range(n_optimizer):
        index = costs.nvme_starts[n_optimizer - position]
        size = costs.host_fp32_tensor_bytes[index + 1] - costs.host_fp32_tensor_bytes[index]
        per_chunk.append(host_bytes.round_up(size, host_bytes.NVME_BLOCK_BYTES))
        sharing[position % slots] += 1
    read = sum(tensors * size for position, size in enumerate(per_chunk) if sharing[position % slots] > 1)
    written = tensors * sum(per_chunk)
    if keeps_gradients:
        read += sum(per_chunk[host_bytes.NVME_GRADIENT_BUFFERS :])
        written += sum(per_chunk)
    return read, written


def offloaded_host_bytes(costs: ChunkCosts, n_persist: int, *, keeps_gradients: bool, n_optimizer: int = 0) -> int:
    """What chunks [n_persist, n) take in host memory on rank 0: their state's region and the
    staging regions (profiler/host_bytes.py, the runtime's own sizes); the last ``n_optimizer``
    trainable ones keep their optimizer state on NVMe instead (their host slots counted)."""
    n = costs.num_chunks
    if n_persist >= n:
        return 0
    payload = (1 + costs.optimizer_states + (1 if keeps_gradients else 0)) * int(
        _span(costs.host_fp32_tensor_bytes, n_persist, n)
    )
    # The NVMe chunks' file tensors and kept gradients leave host memory; a master that goes
    # leaves its compute copy.
    start = nvme_start(costs, n_optimizer)
    in_files = host_bytes.nvme_tensors(costs.optimizer_states, costs.element_size) + (1 if keeps_gradients else 0)
    payload -= in_files * int(_span(costs.host_fp32_tensor_bytes, start, n))
    if costs.element_size != host_bytes.FP32_BYTES:
        payload += int(_span(costs.host_copy_bytes, start, n))
    payload += int(_span(costs.host_frozen_bytes, n_persist, n))
    tensors = host_bytes.nvme_tensors(costs.optimizer_states, costs.element_size)
    slots = host_bytes.nvme_slot_bytes(costs.shard_numel, tensors, n_nvme=n_optimizer)
    slots += host_bytes.nvme_gradient_bytes(costs.shard_numel, n_nvme=n_optimizer, keeps_gradients=keeps_gradients)
    return (
        host_bytes.region_bytes(payload)
        + slots
        + host_bytes.staging_bytes(
            costs.shard_numel,
            element_size=costs.element_size,
            offloaded_trainable=_span(costs.trainable_chunks, n_persist, n) > 0,
            keeps_gradients=keeps_gradients,
            downcasts=_span(costs.trainable_chunks, n_persist, n) > n_optimizer,
        )
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
