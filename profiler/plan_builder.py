"""Building a Plan from the knobs a spec sets: the resident rule (every "auto" knob keeps the
model on the device) and the searched plan (the fastest that fits, by the cost model over the
profiles). Hand-set knobs are kept as given in both.

Pure functions over plain values and profiles: no torch. The Plan value itself is
``profiler/plan.py``, which imports none of this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protrain.profiler.activation_cost import activation_options, block_layout
from protrain.profiler.chunking import ChunkTooSmallError, min_buffers, pack, search_chunk_size
from protrain.profiler.host_bytes import ADAMW_STATES
from protrain.profiler.plan import BlockMode, Plan, UpdateMode, format_bytes
from protrain.profiler.profile import HardwareProfile, ModelProfile
from protrain.profiler.search import SearchResult, search


@dataclass(frozen=True, slots=True, kw_only=True)
class KnobRequest:
    """Knob values from the spec: an int set by hand, or None for "auto"."""

    chunk_size: int | None = None
    n_persist: int | None = None
    n_buffer: int | None = None
    n_replicate: int | None = None
    n_optimizer: int | None = 0
    """None: searched where a disk was measured (``ssd_available``), else 0."""
    n_swap: int | None = None
    n_checkpoint: int | None = None
    n_offload: int | None = None
    block_modes: tuple[BlockMode, ...] | None = None


def resident_plan(
    *,
    request: KnobRequest,
    param_sizes: Sequence[tuple[int, bool]],
    element_size: int,
    num_blocks: int,
    world_size: int,
    micro_batch_size: int,
    precision: str,
    device_budget_bytes: int,
    host_budget_bytes: int,
    chosen: tuple[str, ...],
    module_params: Sequence[Sequence[int]] = (),
    update_mode: UpdateMode = UpdateMode.EARLY,
) -> Plan:
    """Fill every "auto" knob so that nothing leaves the device: all chunks persistent, no
    buffers, every block kept. Hand-set knobs are kept as given; when a hand-set ``n_persist``
    offloads chunks, an "auto" ``n_buffer`` is the fewest buffers every module needs plus one to
    prefetch into (at most one per offloaded chunk).

    ``param_sizes``: (numel, trainable) of each unique parameter in execution order;
    ``element_size``: bytes per element of the chunked (compute-precision) parameters;
    ``module_params``: per module, the indices into ``param_sizes`` of its own parameters."""
    chunk_size = request.chunk_size or search_chunk_size(param_sizes, element_size, world_size)
    try:
        packing = pack(param_sizes, max(1, chunk_size // element_size), world_size)
        num_chunks = packing.num_chunks
    except ChunkTooSmallError as err:
        raise ValueError(f"memory.chunk_size={format_bytes(chunk_size)} is too small: {err}") from None
    modes = block_modes_for(request, num_blocks)
    n_persist = num_chunks if request.n_persist is None else request.n_persist
    if n_persist > num_chunks:
        raise ValueError(
            f"memory.n_persist={n_persist} exceeds the model's {num_chunks} chunks of {format_bytes(chunk_size)}"
        )
    n_replicate = replicated_count(request, n_persist)
    n_buffer = request.n_buffer
    if n_buffer is None:
        need = min_buffers(packing, module_params, n_persist)
        n_buffer = min(need + 1, num_chunks - n_persist) if need else 0
    return Plan(
        world_size=world_size,
        micro_batch_size=micro_batch_size,
        precision=precision,
        chunk_size=chunk_size,
        num_chunks=num_chunks,
        n_persist=n_persist,
        n_buffer=n_buffer,
        n_replicate=n_replicate,
        n_optimizer=request.n_optimizer or 0,
        **mode_counts(modes),
        device_budget_bytes=device_budget_bytes,
        host_budget_bytes=host_budget_bytes,
        chosen=chosen,
        update_mode=update_mode,
        rule="resident: auto knobs keep every chunk persistent and every block kept"
        + ("" if all(m is BlockMode.KEEP for m in modes) else " (block modes as set by hand)"),
    )


def replicated_count(request: KnobRequest, n_persist: int) -> int:
    """The replicated chunks of a plan made without a profile: hand-set, at most the persistent
    ones; "auto" replicates none (the search chooses it once a batch is profiled)."""
    n_replicate = request.n_replicate or 0
    if n_replicate > n_persist:
        raise ValueError(
            f"memory.n_replicate={n_replicate} exceeds the {n_persist} persistent chunks "
            "(memory.n_persist): only persistent chunks are replicated"
        )
    return n_replicate


def default_block_layout(num_blocks: int, *, n_offload: int, n_swap: int, n_checkpoint: int) -> tuple[BlockMode, ...]:
    """DESIGN section 4's order (``activation_cost.block_layout``) as ``BlockMode`` values."""
    return tuple(
        BlockMode(mode)
        for mode in block_layout(num_blocks, n_offload=n_offload, n_swap=n_swap, n_checkpoint=n_checkpoint)
    )


def mode_counts(modes: tuple[BlockMode, ...]) -> dict[str, Any]:
    """The Plan fields that follow from the per-block modes."""
    return {
        "n_swap": modes.count(BlockMode.SWAP),
        "n_checkpoint": modes.count(BlockMode.CHECKPOINT),
        "n_offload": modes.count(BlockMode.SSD),
        "block_modes": modes,
    }


def block_modes_for(request: KnobRequest, num_blocks: int) -> tuple[BlockMode, ...]:
    """The explicit ``block_modes``, or the default layout of the hand-set counts (auto: 0)."""
    if request.block_modes is not None:
        modes = tuple(request.block_modes)
        if len(modes) != num_blocks:
            raise ValueError(f"memory.block_modes lists {len(modes)} modes but the model has {num_blocks} blocks")
    else:
        counts = [request.n_offload or 0, request.n_swap or 0, request.n_checkpoint or 0]
        if sum(counts) > num_blocks:
            raise ValueError(
                f"ssd.n_offload + n_swap + n_checkpoint = {sum(counts)} exceeds the model's {num_blocks} blocks"
            )
        modes = default_block_layout(num_blocks, n_offload=counts[0], n_swap=counts[1], n_checkpoint=counts[2])
    return tuple(modes)


def activations_searchable(request: KnobRequest) -> bool:
    """Whether any activation count is left to the search (an explicit list fixes them all)."""
    return request.block_modes is None and None in (request.n_swap, request.n_checkpoint, request.n_offload)


def _layout_words(modes: tuple[str, ...] | None) -> str:
    if not modes or all(mode == BlockMode.KEEP.value for mode in modes):
        return ""
    counts = {mode: modes.count(mode) for mode in ("swap", "checkpoint", "ssd") if modes.count(mode)}
    return ", " + ", ".join(f"{count} {mode}" for mode, count in counts.items())


def searched_plan(
    *,
    request: KnobRequest,
    model: ModelProfile,
    hardware: HardwareProfile,
    num_blocks: int,
    micro_batch_size: int,
    device_budget_bytes: int,
    host_budget_bytes: int,
    chosen: tuple[str, ...],
    extra_buffers: int | None = None,
    ssd_available: bool = False,
    update_mode: UpdateMode = UpdateMode.EARLY,
    host_fixed_bytes: int = 0,
    optimizer_states: int = ADAMW_STATES,
    disk_room: int | None = None,
    max_writes_per_day: float | None = None,
) -> tuple[Plan, SearchResult]:
    """The fastest plan that fits, by the cost model over the profiles; hand-set knobs stay.
    Activation counts left auto are searched with the chunk knobs (ssd only when
    ``ssd_available``: a path is set and its disk was measured; ``update_mode``: how offloaded
    chunks are updated, which the cost model times; ``optimizer_states``: the optimizer rule's
    fp32 state tensors per parameter; ``disk_room`` and ``max_writes_per_day``: the disk's
    bytes per rank and the NVMe tier's write limit, search.py's). Raises NoPlanFitsError (a
    ValueError) saying what would fit."""
    if request.n_persist is not None:
        replicated_count(request, request.n_persist)  # refused before the search, by name
    layouts = None
    if activations_searchable(request) and len(model.blocks) == num_blocks:
        layouts = activation_options(
            model,
            hardware,
            n_swap=request.n_swap,
            n_checkpoint=request.n_checkpoint,
            n_offload=request.n_offload,
            ssd=ssd_available,
        )
    fixed = None if layouts is not None else block_modes_for(request, num_blocks)
    result = search(
        model,
        hardware,
        device_budget=device_budget_bytes,
        host_budget=host_budget_bytes,
        chunk_size=request.chunk_size,
        n_persist=request.n_persist,
        n_buffer=request.n_buffer,
        extra_buffers=extra_buffers,
        block_modes=None if fixed is None else [mode.value for mode in fixed],
        activation_layouts=layouts,
        updates_after_norm=update_mode.updates_after_norm,
        keeps_gradients=update_mode.keeps_gradients,
        host_fixed=host_fixed_bytes,
        optimizer_states=optimizer_states,
        n_replicate=request.n_replicate,
        n_optimizer=request.n_optimizer if request.n_optimizer is not None or ssd_available else 0,
        disk_room=disk_room,
        max_writes_per_day=max_writes_per_day,
    )
    best = result.best
    if fixed is not None:
        modes = fixed
    elif best.block_modes is not None:
        modes = tuple(BlockMode(mode) for mode in best.block_modes)
    else:
        modes = (BlockMode.KEEP,) * num_blocks
    plan = Plan(
        world_size=hardware.world_size,
        micro_batch_size=micro_batch_size,
        precision=model.precision,
        chunk_size=best.chunk_size,
        num_chunks=best.num_chunks,
        n_persist=best.n_persist,
        n_buffer=best.n_buffer,
        n_replicate=best.n_replicate,
        n_optimizer=best.n_optimizer,
        **mode_counts(modes),
        device_budget_bytes=device_budget_bytes,
        host_budget_bytes=host_budget_bytes,
        chosen=chosen,
        update_mode=update_mode,
        rule=f"search: fastest of {result.evaluated} plans that fit; {result.binding}",
        batch_shape=model.batch_shape,
        predicted_step_s=best.prediction.step_s,
        predicted_compute_s=best.prediction.forward_s + best.prediction.backward_s,
        predicted_peak_device_bytes=best.prediction.peak_device_bytes,
        predicted_peak_host_bytes=best.prediction.host_bytes + host_fixed_bytes,
        host_fixed_bytes=host_fixed_bytes,
        predicted_ssd_bytes=best.prediction.ssd_bytes or None,
        predicted_nvme_bytes=best.prediction.nvme_bytes or None,
        notes=tuple(
            f"runner-up: chunk_size {format_bytes(c.chunk_size)}, n_persist={c.n_persist} of {c.num_chunks}, "
            f"n_buffer={c.n_buffer}{_layout_words(c.block_modes)}: "
            f"{c.prediction.step_s:.3f} s, {format_bytes(c.prediction.peak_device_bytes)}"
            for c in result.runners_up
        )
        + transfer_notes(hardware),
    )
    return plan, result


def transfer_notes(hardware: HardwareProfile) -> tuple[str, ...]:
    """Where copies overlap compute (a GPU): the link rates the plan was costed with, and the link
    they run over when NVML named it (a rate far below the link's points at a slot or a setting)."""
    if not hardware.copies_overlap_compute:
        return ()
    link = f" over {hardware.link}" if hardware.link else ""
    return (
        f"transfers: host->device {hardware.h2d_bytes_per_s / 1e9:.1f} GB/s, device->host "
        f"{hardware.d2h_bytes_per_s / 1e9:.1f} GB/s measured{link}",
    )
