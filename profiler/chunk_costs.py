"""Per chunk size, every term the cost model's formulas need, as prefix sums over the chunks in
execution order (profiler/cost_model.py says what each term is and how the formulas use them):
built once per chunk size, so that each plan the search evaluates costs O(1).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from protrain.profiler import host_bytes
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
    bwd_replicated: tuple[float, ...]
    """Backward of a replicated chunk: its gradients all-reduced (as DDP's) instead of
    reduce-scattered."""
    replicated_update: tuple[float, ...]
    """A replicated chunk's device optimizer over the whole chunk, its norm and zeroing passes
    and its full copy refreshed from its master (no all-gather)."""
    replicated_bytes: tuple[int, ...]
    """Device bytes of a replicated persistent chunk: the whole chunk's state on every rank."""
    host_fp32_tensor_bytes: tuple[int, ...]
    """One fp32 state tensor of each trainable chunk's host shard (master, each moment, the
    gradient when kept: each takes this), were the chunk offloaded."""
    host_frozen_bytes: tuple[int, ...]
    """A frozen chunk's host shard, were it offloaded."""
    host_copy_bytes: tuple[int, ...]
    """A trainable chunk's host shard in the compute dtype: what the host keeps of it when its
    master is on NVMe (a compute dtype other than fp32)."""
    trainable_chunks: tuple[int, ...]
    nvme_starts: tuple[int, ...]
    """For k = 0, 1, ...: the first chunk of the last k trainable ones (the NVMe tier's chunks
    with ``n_optimizer`` = k, were they offloaded)."""
    unattributed_forward_s: float
    unattributed_backward_s: float
    direct_grads_possible: bool
    """One rank in fp32: persistent chunks' gradients need no chunk-sized buffer."""
    activation_bytes: int
    transient_bytes: int


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
        f, whole_b = fwd_c[index], bwd_c[index]
        # Gradients that go through a chunk-sized buffer (runtime/chunks/reduce.py) pay its
        # zero-fill and an add of each gradient into it, which the profile's backward leaves out
        # (a profiling step drops its gradients); accumulated straight into the shard, nothing.
        fill = (chunk_numel + 3 * chunk.used) * e / hardware.memory_bytes_per_s if chunk.trainable else 0.0
        b = whole_b + (0.0 if alias else fill)
        b_offloaded = whole_b + (0.0 if alias and not overlap else fill)
        b_replicated = whole_b + (0.0 if e == 4 else fill)
        reduce = scatter if chunk.trainable else 0.0
        off = offload if chunk.trainable else 0.0
        rows["fwd"].append(f)
        rows["fwd_serial"].append(f + fetch)
        if overlap:
            rows["fwd_overlapped"].append(max(f, fetch))
            rows["bwd_persistent"].append(max(b, reduce))
            rows["bwd_reused"].append(max(b_offloaded, reduce + off))
            rows["bwd_fetched"].append(max(b_offloaded, fetch + reduce + off))
            rows["bwd_fetched_serial"].append(max(b_offloaded + fetch, reduce + off))
        else:  # the same cores do both: nothing hides
            rows["fwd_overlapped"].append(f + fetch)
            rows["bwd_persistent"].append(b + reduce)
            rows["bwd_reused"].append(b_offloaded + reduce + off)
            rows["bwd_fetched"].append(b_offloaded + fetch + reduce + off)
            rows["bwd_fetched_serial"].append(b_offloaded + fetch + reduce + off)
        rows["adam_params"].append(chunk.used / world if chunk.trainable else 0.0)
        rows["adam_segments"].append(float(len(chunk.members)) if chunk.trainable else 0.0)
        rows["host_adds"].append(add if chunk.trainable else 0.0)
        rows["host_widens"].append(widen if chunk.trainable else 0.0)
        stored = host_bytes.rank_numel(chunk.used, shard, 0)  # rank 0 holds the most
        rows["trainable_chunks"].append(1 if chunk.trainable else 0)
        # The norm's read and the zeroing write; an in-place shard is copied over, not zeroed.
        passes = 1 if alias else 2
        rows["update_passes"].append(passes * 4 * shard / hardware.memory_bytes_per_s if chunk.trainable else 0.0)
        host_passes = 1 if alias and not overlap else 2
        rows["host_update_passes"].append(host_passes * 4 * shard / copy_rate if chunk.trainable else 0.0)
        rows["refresh"].append(gather if chunk.trainable else 0.0)
        persistent = persistent_chunk_bytes(
            chunk, chunk_numel=chunk_numel, world_size=world, element_size=e, optimizer_states=optimizer_states
        )
        rows["persistent_bytes"].append(persistent)
        # Replicated: one all-reduce per gradient (at its measured rate), every rank updating
        # the whole chunk, its copy refreshed locally; the state of one rank.
        all_reduce = (chunk_bytes / hardware.all_reduce_bytes_per_s + latency if world > 1 else 0.0) * (
            1.0 if chunk.trainable else 0.0
        )
        # In fp32 autograd accumulates a replicated chunk's gradients into its shard: no buffer.
        rows["bwd_replicated"].append(max(b_replicated, all_reduce) if overlap else b_replicated + all_reduce)
        whole_update = (
            chunk.used / hardware.device_adam_params_per_s
            + (1 if e == 4 else 2) * 4 * chunk_numel / hardware.memory_bytes_per_s
        )
        whole_update += chunk.used * e / hardware.memory_bytes_per_s if e != 4 else 0.0  # the refresh copy
        rows["replicated_update"].append(whole_update if chunk.trainable else 0.0)
        rows["replicated_bytes"].append(
            persistent_chunk_bytes(
                chunk, chunk_numel=chunk_numel, world_size=1, element_size=e, optimizer_states=optimizer_states
            )
        )
        if chunk.trainable:
            rows["host_fp32_tensor_bytes"].append(host_bytes.tensor_bytes(stored, 4))
            rows["host_frozen_bytes"].append(0)
            rows["host_copy_bytes"].append(host_bytes.tensor_bytes(stored, e))
        else:
            rows["host_copy_bytes"].append(0)
            rows["host_fp32_tensor_bytes"].append(0)
            rows["host_frozen_bytes"].append(host_bytes.tensor_bytes(stored, e))
    need = min_buffers_by_persist(packing, model.module_params)
    prefixed = {name: tuple(accumulate(values, initial=0)) for name, values in rows.items()}
    trainable = [index for index, flag in enumerate(rows["trainable_chunks"]) if flag]
    return ChunkCosts(
        nvme_starts=(packing.num_chunks, *reversed(trainable)),
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
    "bwd_replicated",
    "replicated_update",
    "replicated_bytes",
    "host_fp32_tensor_bytes",
    "host_frozen_bytes",
    "host_copy_bytes",
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
