"""Hand-set chunk knobs that no plan can honour, whatever the memory budgets, and what would work.

Two things make a set of hand-set chunk knobs impossible before any cost is predicted:

- ``n_persist`` larger than the model's number of chunks;
- ``n_buffer`` below the buffers ``n_persist`` leaves necessary: a module's own parameters must
  be on the device together, so the module whose parameters span the most offloaded chunks sets
  the fewest buffers (at least one as soon as any chunk is offloaded).

(A chunk smaller than the largest parameter is the third; the planner names that parameter
itself, since only it knows the names.) For each conflict the message gives the smallest value of
each hand-set knob that works with the others held as set, so the user can change the one they
care least about. Pure functions over parameter sizes: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from protrain.profiler.chunking import ChunkTooSmallError, Packing, min_buffers_by_persist, pack

CHUNK_STEPS = (1.0, 1.25, 1.5, 1.75)
"""The chunk sizes tried for a suggestion: each power of two times these (the search's grid)."""


@dataclass(frozen=True, slots=True)
class _Packed:
    """One chunk size's packing, and the fewest buffers for each ``n_persist`` in [0, num_chunks]."""

    chunk_size: int
    packing: Packing
    need: tuple[int, ...]

    @property
    def num_chunks(self) -> int:
        return self.packing.num_chunks

    def works(self, n_persist: int, n_buffer: int | None) -> bool:
        """Whether some plan has these knobs (an auto ``n_buffer`` takes what ``n_persist``
        needs; keeping every chunk needs no buffer)."""
        if n_persist > self.num_chunks:
            return False
        return n_persist == self.num_chunks or n_buffer is None or n_buffer >= self.need[n_persist]


def chunk_knob_conflict(
    sizes: Sequence[tuple[int, bool]],
    module_params: Sequence[Sequence[int]],
    *,
    element_size: int,
    world_size: int,
    chunk_sizes: Sequence[int],
    chunk_size_hand_set: bool,
    n_persist: int | None,
    n_buffer: int | None,
    module_names: Sequence[str] | None = None,
) -> str | None:
    """Why no plan can honour the hand-set ``n_persist``/``n_buffer`` at any of ``chunk_sizes``
    (bytes: the hand-set chunk size, or the sizes the search tries), with the smallest value of
    each hand-set knob that works; None when some plan can. ``sizes``: (numel, trainable) per
    parameter in execution order; ``module_params``: per module, indices into ``sizes``;
    ``module_names``: the same modules' names, for the message."""
    if n_persist is None:
        return None  # every chunk persistent (no buffers) is always a plan
    packed = [_pack(sizes, module_params, size, element_size, world_size) for size in chunk_sizes]
    fitting = [p for p in packed if p is not None]
    if not fitting or any(p.works(n_persist, n_buffer) for p in fitting):
        return None  # (a chunk smaller than a parameter is the planner's to name)
    most = max(p.num_chunks for p in fitting)
    if n_persist > most:
        return (
            f"memory.n_persist={n_persist} exceeds the model's {most} chunks "
            f"{_where(fitting, chunk_size_hand_set)}: the largest n_persist that works is {most} "
            "(every chunk on the device); set at most that, or auto"
        )
    assert n_buffer is not None, "an auto n_buffer always takes the buffers n_persist needs"
    fewest = min((p for p in fitting if n_persist < p.num_chunks), key=lambda p: p.need[n_persist])
    lines = [
        _too_few_buffers(fewest, n_persist, n_buffer, module_params, module_names, chunk_size_hand_set),
        _with_more_persistent(fitting, n_buffer),
    ]
    if chunk_size_hand_set:
        size = smallest_chunk_size(
            sizes,
            module_params,
            element_size=element_size,
            world_size=world_size,
            n_persist=n_persist,
            n_buffer=n_buffer,
        )
        lines.append(
            f"or, keeping n_persist={n_persist} and n_buffer={n_buffer}, the smallest chunk_size that "
            f"works is {spec_size(size)} (of the sizes 2^k x 1, 1.25, 1.5, 1.75)"
            if size is not None
            else f"no chunk_size works with n_persist={n_persist} and n_buffer={n_buffer}"
        )
    lines.append("or leave these knobs auto")
    return "; ".join(lines)


def _too_few_buffers(
    packed: _Packed,
    n_persist: int,
    n_buffer: int,
    module_params: Sequence[Sequence[int]],
    module_names: Sequence[str] | None,
    chunk_size_hand_set: bool,
) -> str:
    """The first sentence: who needs how many buffers, and the smallest ``n_buffer``."""
    need = packed.need[n_persist]
    module = _widest_module(packed.packing, module_params, n_persist)
    if module is not None and need >= 2:
        who = f"module {module_names[module]!r}" if module_names else "one module"
        why = f"{who} uses {need} non-persistent chunks at once (its parameters must be on the device together)"
    else:
        why = "an offloaded chunk is used from a device buffer"
    size = spec_size(packed.chunk_size)
    chunks = f"chunks of {size}" if chunk_size_hand_set else f"chunks of {size} (the search's best case)"
    return (
        f"memory.n_buffer={n_buffer} is too few: {why}, with n_persist={n_persist} and {chunks}; the "
        f"smallest n_buffer that works is {need}: set memory.n_buffer >= {need}"
    )


def _with_more_persistent(packed: Sequence[_Packed], n_buffer: int) -> str:
    """The smallest ``n_persist`` that works with ``n_buffer`` at any of the sizes: the fewest
    buffers never grow with ``n_persist``, and keeping every chunk needs none."""
    persist, every = min(
        (next(p for p in range(item.num_chunks + 1) if item.works(p, n_buffer)), item.num_chunks) for item in packed
    )
    note = " (every chunk on the device)" if persist == every else ""
    return f"or, keeping n_buffer={n_buffer}, the smallest n_persist that works is {persist}{note}"


def _widest_module(packing: Packing, module_params: Sequence[Sequence[int]], n_persist: int) -> int | None:
    """The index of the module whose parameters span the most offloaded chunks."""
    spans = [
        len({packing.placement[i][0] for i in members if packing.placement[i][0] >= n_persist})
        for members in module_params
    ]
    return None if not spans else max(range(len(spans)), key=spans.__getitem__)


def smallest_chunk_size(
    sizes: Sequence[tuple[int, bool]],
    module_params: Sequence[Sequence[int]],
    *,
    element_size: int,
    world_size: int,
    n_persist: int,
    n_buffer: int,
) -> int | None:
    """The smallest chunk size (bytes, from the largest parameter up to the whole model, on the
    ``CHUNK_STEPS`` grid) at which ``n_persist`` and ``n_buffer`` work; None when none does.
    Packing is not monotone in the chunk size (a module may straddle a boundary at a larger size
    that it did not at a smaller one), so every size is tried in order."""
    largest = max((numel for numel, _ in sizes), default=1) * element_size
    total = sum(numel for numel, _ in sizes) * element_size
    for size in _grid(largest, max(largest, total)):
        packed = _pack(sizes, module_params, size, element_size, world_size)
        if packed is not None and packed.works(n_persist, n_buffer):
            return size
    return None


def _grid(low: int, high: int) -> list[int]:
    """``low``, then each power of two times ``CHUNK_STEPS`` within [low, high], ascending."""
    sizes = {low}
    power = 1 << max(0, low.bit_length() - 1)
    while power <= high:
        sizes.update(int(power * step) for step in CHUNK_STEPS if low <= power * step <= high)
        power <<= 1
    return sorted(sizes)


def _pack(
    sizes: Sequence[tuple[int, bool]],
    module_params: Sequence[Sequence[int]],
    chunk_size: int,
    element_size: int,
    world_size: int,
) -> _Packed | None:
    """The packing at ``chunk_size`` bytes; None when a parameter does not fit a chunk."""
    try:
        packing = pack(sizes, max(1, chunk_size // element_size), world_size)
    except ChunkTooSmallError:
        return None
    return _Packed(chunk_size, packing, min_buffers_by_persist(packing, module_params))


def _where(packed: Sequence[_Packed], chunk_size_hand_set: bool) -> str:
    if chunk_size_hand_set or len(packed) == 1:
        return f"of {spec_size(packed[0].chunk_size)}"
    sizes = sorted(p.chunk_size for p in packed)
    return f"at any chunk size the search tries ({spec_size(sizes[0])} to {spec_size(sizes[-1])})"


def spec_size(num_bytes: int) -> str:
    """A size as the spec reads it: ``64KiB`` when it is a whole number of a binary unit, else
    plain bytes."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return str(num_bytes)
