"""Packing parameters into fixed-size chunks, and choosing the chunk size.

Pure functions over parameter sizes (no torch), shared by the planner (which needs the number of
chunks and the wasted bytes for every candidate size) and by the runtime's chunk layout (which
needs each parameter's place), so the two can never disagree.

Packing rules (ProTrain section 3, Gemini's chunk manager):
- parameters are taken in first-use order and never split across chunks, so a chunk holds whole
  parameters and prefetch follows execution order;
- trainable and frozen parameters go to different chunks (a frozen chunk has no gradient or
  optimizer state);
- every chunk has the same capacity (the device buffers are interchangeable), rounded up to a
  multiple of the world size so that each rank owns an equal shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from protrain.profiler.host_bytes import ADAMW_STATES, rank_numel

MIB = 1 << 20
PREFERRED_MIN_CHUNK_BYTES = 32 * MIB
"""Below this, per-chunk collective and copy latency starts to dominate on real hardware."""
MAX_CHUNK_BYTES = 256 * MIB
MIN_CHUNKS_FOR_SMALL_MODELS = 64
"""A model smaller than 64 x 32 MiB is still split into up to about this many chunks (never
below its largest parameter), so that offloading it can be planned at all, and fit a budget of a
quarter of its fp32 size: with every chunk offloaded the device holds two buffers and a gradient
buffer, 3/8 of the model at 8 chunks (tested on tiny models under the device wall)."""


@dataclass(frozen=True, slots=True)
class PackedChunk:
    trainable: bool
    used: int
    """Elements occupied by parameters."""
    members: tuple[int, ...]
    """Indices (into the packed sequence) of the parameters in this chunk, in order."""


@dataclass(frozen=True, slots=True)
class Packing:
    chunk_numel: int
    """Capacity of every chunk in elements (a multiple of the world size)."""
    chunks: tuple[PackedChunk, ...]
    placement: tuple[tuple[int, int], ...]
    """(chunk index, element offset) of each parameter, in input order."""

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def wasted_numel(self) -> int:
        return sum(self.chunk_numel - chunk.used for chunk in self.chunks)


class ChunkTooSmallError(ValueError):
    pass


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def pack(sizes: Sequence[tuple[int, bool]], chunk_numel: int, world_size: int) -> Packing:
    """Pack parameters given as ``(numel, trainable)`` in first-use order.

    Chunks are listed in the order their first parameter appears, so the chunk sequence follows
    execution order too. Raises ChunkTooSmallError when one parameter exceeds the capacity.
    """
    capacity = round_up(chunk_numel, world_size)
    largest = max((numel for numel, _ in sizes), default=0)
    if largest > capacity:
        raise ChunkTooSmallError(f"a parameter of {largest:,} elements does not fit a chunk of {capacity:,} elements")
    open_chunk: dict[bool, int] = {}
    used: list[int] = []
    members: list[list[int]] = []
    kinds: list[bool] = []
    placement: list[tuple[int, int]] = []
    for index, (numel, trainable) in enumerate(sizes):
        chunk = open_chunk.get(trainable)
        if chunk is None or used[chunk] + numel > capacity:
            chunk = len(used)
            open_chunk[trainable] = chunk
            used.append(0)
            members.append([])
            kinds.append(trainable)
        placement.append((chunk, used[chunk]))
        used[chunk] += numel
        members[chunk].append(index)
    chunks = tuple(PackedChunk(kinds[i], used[i], tuple(members[i])) for i in range(len(used)))
    return Packing(chunk_numel=capacity, chunks=chunks, placement=tuple(placement))


def candidate_chunk_bytes(total_bytes: int, largest_param_bytes: int) -> list[int]:
    """The grid, scaled to the model: sizes 2^k x {1, 1.25, 1.5, 1.75} from a floor to a cap.

    Floor: 32 MiB, or about total/64 for models smaller than 64 x 32 MiB; never below the largest
    parameter. Cap: 256 MiB or twice the floor, whichever is larger, but not above the whole
    model (and never below the floor).
    """
    small_floor = 1 << max(10, math.ceil(math.log2(max(1, total_bytes // MIN_CHUNKS_FOR_SMALL_MODELS))))
    floor = max(min(PREFERRED_MIN_CHUNK_BYTES, small_floor), largest_param_bytes)
    # A parameter larger than the usual cap (a big vocabulary's embedding) sets the floor; going
    # up to twice that lets the other parameters pack without wasting a third of each chunk.
    cap = max(floor, min(MAX_CHUNK_BYTES, total_bytes), min(2 * floor, total_bytes))
    grid: set[int] = {floor, cap}
    power = 1 << max(0, math.floor(math.log2(floor)))
    while power <= cap:
        for factor in (1.0, 1.25, 1.5, 1.75):
            size = int(power * factor)
            if floor <= size <= cap:
                grid.add(size)
        power <<= 1
    return sorted(grid)


SHRINK_WRAP_ALIGN_BYTES = 64 << 10
"""A shrink-wrapped chunk size is rounded up to this (64 KiB: sizes stay readable)."""


def search_chunk_bytes(sizes: Sequence[tuple[int, bool]], element_size: int, world_size: int) -> list[int]:
    """The chunk sizes a search tries: the grid (``candidate_chunk_bytes``) and each grid size
    shrink-wrapped, cut to its fullest chunk (rounded up to 64 KiB). A shrink-wrapped size packs
    the parameters exactly as its grid size does (packing is next-fit in order: every chunk's
    contents still fit, and a parameter that opened a new chunk still does not fit the one
    before), without the padding every chunk carries past the fullest one into its device
    buffer, its collectives and its copies: whole parameters of a few sizes pack badly into a
    power-of-two grid (GPT 6 x 512 in 8 MiB chunks: 1.42x its bytes; shrink-wrapped from
    4 MiB + a quarter: 1.06x)."""
    total = sum(numel for numel, _ in sizes) * element_size
    largest = max((numel for numel, _ in sizes), default=1) * element_size
    grid = candidate_chunk_bytes(total, largest)
    chosen = set(grid)
    for size_bytes in grid:
        try:
            packing = pack(sizes, max(1, size_bytes // element_size), world_size)
        except ChunkTooSmallError:
            continue
        fullest = max((chunk.used for chunk in packing.chunks), default=0) * element_size
        wrapped = round_up(max(fullest, 1), SHRINK_WRAP_ALIGN_BYTES)
        if wrapped < size_bytes:
            chosen.add(wrapped)
    return sorted(chosen)


def search_chunk_size(sizes: Sequence[tuple[int, bool]], element_size: int, world_size: int) -> int:
    """The chunk size in bytes that wastes the fewest bytes over the search's sizes; ties go to
    the larger size (fewer chunks, fewer collectives)."""
    best: tuple[int, int] | None = None
    for size_bytes in search_chunk_bytes(sizes, element_size, world_size):
        packing = pack(sizes, max(1, size_bytes // element_size), world_size)
        key = (packing.wasted_numel * element_size, -size_bytes)
        if best is None or key < best:
            best = key
    assert best is not None
    return -best[1]


def smallest_chunk_size(sizes: Sequence[tuple[int, bool]], element_size: int) -> int:
    """The largest parameter's bytes (at least a KiB): with every chunk offloaded, the chunk
    size at which the device holds the least of the model (a rule's plan until a profile lets
    the search choose)."""
    return max(1024, max((numel for numel, _ in sizes), default=1) * element_size)


def min_buffers(packing: Packing, module_params: Sequence[Sequence[int]], n_persist: int) -> int:
    """The fewest device chunk buffers with which every module can run: a module's own
    parameters must be resident together, so it is the most non-persistent chunks one module's
    parameters span (at least 1 when any chunk is offloaded; 0 when none is).

    ``module_params``: per module, the indices (into the packed sequence) of its own parameters.
    """
    if n_persist >= packing.num_chunks:
        return 0
    need = 1
    for members in module_params:
        offloaded = {packing.placement[i][0] for i in members} - set(range(n_persist))
        need = max(need, len(offloaded))
    return need


def min_buffers_by_persist(packing: Packing, module_params: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """``min_buffers`` for every ``n_persist`` in [0, num_chunks], in one pass over the modules."""
    n = packing.num_chunks
    # most[c]: the largest count j such that some module's j-th chunk from its last is chunk c;
    # with the first n_persist chunks persistent, that module spans j offloaded chunks if c >= n_persist.
    most = [0] * n
    for members in module_params:
        chunks = sorted({packing.placement[i][0] for i in members})
        for j, chunk in enumerate(reversed(chunks), start=1):
            most[chunk] = max(most[chunk], j)
    need = [0] * (n + 1)
    running = 0
    for p in range(n - 1, -1, -1):
        running = max(running, most[p])
        need[p] = max(1, running)
    return tuple(need)


def persistent_full_numel(used: int, *, trainable: bool, chunk_numel: int, world_size: int) -> int:
    """Elements of a persistent chunk's full compute copy: its used elements, unless an
    all-gather refills it after every update (trainable, several ranks), which needs the whole
    padded chunk. Persistent chunks never pass through the uniform buffers, so their padding
    would be device memory holding nothing."""
    return chunk_numel if trainable and world_size > 1 else used


def persistent_chunk_bytes(
    chunk: PackedChunk, *, chunk_numel: int, world_size: int, element_size: int, optimizer_states: int = ADAMW_STATES
) -> int:
    """Device bytes of one persistent chunk on rank 0 (which holds the most): its full compute
    copy (``persistent_full_numel``) and, trainable, the fp32 master (shared with the copy for
    one rank in fp32), gradient and the optimizer's ``optimizer_states`` fp32 tensors of rank 0's
    real elements; frozen, the copy alone (the shard is a view of it)."""
    full = (
        persistent_full_numel(chunk.used, trainable=chunk.trainable, chunk_numel=chunk_numel, world_size=world_size)
        * element_size
    )
    if not chunk.trainable:
        return full
    stored = rank_numel(chunk.used, chunk_numel // world_size, 0)
    alias = world_size == 1 and element_size == 4
    return full + stored * ((0 if alias else 4) + 4 + 4 * optimizer_states)
