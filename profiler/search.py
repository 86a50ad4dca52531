"""The knob search: the fastest plan whose predicted memory fits, the runners-up, and what binds.

Enumerates chunk size x ``n_persist`` x ``n_buffer`` x the blocks' activation layouts
(``n_swap`` x ``n_checkpoint`` x ``ssd.n_offload``, profiler/activation_cost.py): every chunk plan
is predicted with each layout worth trying (the undominated ones; see ``activation_options``) and
keeps the fastest layout that fits. Knobs set by hand stay fixed; fixed modes are one layout.

Pruning, memory first (profiler/search_pruning.py): only a few buffer counts are predicted per
``n_persist``, and the ``n_persist`` loop stops once no larger one can fit. Neither drops the
fastest plan that fits, so the best step time equals a brute-force search's, and a larger budget
never gives a slower best plan.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial

from protrain.profiler.activation_cost import ActivationCost, ActivationOption, activation_cost
from protrain.profiler.chunking import ChunkTooSmallError, search_chunk_bytes
from protrain.profiler.cost_model import (
    ChunkCosts,
    Prediction,
    chunk_costs,
    memory_with_activations,
    nvme_start,
    predict,
    with_activations,
)
from protrain.profiler.feasibility import chunk_knob_conflict
from protrain.profiler.host_bytes import ADAMW_STATES
from protrain.profiler.nvme_cost import NvmeHosts, writes_per_day
from protrain.profiler.profile import HardwareProfile, ModelProfile
from protrain.profiler.search_pruning import buffer_candidates, most_saved_by_persisting
from protrain.profiler.search_words import (
    binding,
    hand_set,
    layout_words,
    managed,
    nothing_fits,
    waits_for_fetches,
)

SAME_SPEED = 0.02
"""Relative step-time difference below which two plans count as equally fast: the cost model is
not more exact than that (its CPU target is 10%), and persistence is the safer bet."""
SHARED_CORES_CHUNK_BYTES = 25 << 20
"""Where collectives run on the cores compute uses (CPU), equally fast plans take a chunk size
within a factor of sqrt(2) of DDP's bucket size (among those, the least padding: every
collective moves it): a collective interleaved with compute slows it (the same cores and
memory), which the model's sums do not see, while one chunk leaves the whole reduction exposed
after backward. Measured on 2 gloo ranks (GPT 6x512, 19.2M parameters): every chunk replicated,
4 MiB chunks 2.5% slower than 27 MiB ones (backward +41 ms with 19 all-reduces inside it, 27 ms
less waiting after it), one 80 MiB chunk 1.5% slower; every chunk offloaded, 27 MiB chunks 1.03x
DDP's step against 1.05-1.07x for 4 MiB ones."""
MEMORY_MARGIN = 0.05
"""Predicted device peak times (1 + margin) must fit the budget: allocator slack and what the
profile did not see."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    chunk_size: int
    num_chunks: int
    n_persist: int
    n_buffer: int
    prediction: Prediction
    n_replicate: int = 0
    n_optimizer: int = 0
    """Offloaded chunks whose optimizer state is on NVMe (the last trainable ones)."""
    block_modes: tuple[str, ...] | None = None
    """The activation layout this plan runs (None: every block keeps, no activation cost)."""
    activations: ActivationCost | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchResult:
    best: Candidate
    runners_up: tuple[Candidate, ...]
    binding: str
    """What keeps the best plan from being faster, in words."""
    evaluated: int
    """Plans whose cost was predicted."""
    elapsed_s: float


Layout = tuple[tuple[str, ...] | None, ActivationCost | None]
"""Block modes and their cost; (None, None): every block keeps, no activation cost."""


class NoPlanFitsError(ValueError):
    """No plan fits; the message says by how much and what would make one fit."""


def search(
    model: ModelProfile,
    hardware: HardwareProfile,
    *,
    device_budget: int,
    host_budget: int,
    chunk_size: int | None = None,
    n_persist: int | None = None,
    n_buffer: int | None = None,
    margin: float = MEMORY_MARGIN,
    keep: int = 3,
    extra_buffers: int | None = None,
    block_modes: Sequence[str] | None = None,
    activation_layouts: Sequence[ActivationOption] | None = None,
    updates_after_norm: bool = False,
    keeps_gradients: bool = True,
    host_fixed: int = 0,
    optimizer_states: int = ADAMW_STATES,
    n_replicate: int | None = 0,
    n_optimizer: int | None = 0,
    disk_room: int | None = None,
    max_writes_per_day: float | None = None,
) -> SearchResult:
    """The fastest plan that fits ``device_budget`` and ``host_budget`` (bytes per rank;
    ``n_replicate`` of the persistent chunks replicated, so every plan keeps that many, or None:
    on several ranks, as many as fit when that is faster; the
    host holds ``host_fixed`` beside what a plan places: the process's own memory at start, an
    asynchronous save's staging);
    ``chunk_size``/``n_persist``/``n_buffer``, when given, are fixed. ``extra_buffers`` caps the
    buffers tried beyond the fewest that work (for models of hundreds of chunks; None: all).
    Activations: ``activation_layouts`` to choose from (``activation_options``), or one fixed
    ``block_modes``, or neither (every block keeps). ``updates_after_norm``: the update waits
    for the gradient norm (clipping, fp16), which times the step differently
    (profiler.cost_model); ``keeps_gradients``: offloaded chunks keep a gradient shard on the
    host (clipping, fp16, accumulation), 4 bytes per parameter more; ``optimizer_states``: the
    optimizer rule's fp32 state tensors per parameter (AdamW: 2); ``n_optimizer``: the last
    offloaded trainable chunks whose optimizer state is on NVMe (hand-set: every plan keeps it;
    None: as few as make a plan fit host memory, none where it fits without; the search counts
    them only where host memory binds, so the tier is used only for a plan that would not fit
    otherwise, or for a faster activation layout that the RAM it frees lets fit); ``disk_room``:
    bytes per rank the disk holds for activation files and NVMe state (None: no limit);
    ``max_writes_per_day``: plans whose NVMe state writes more per day rank after the others."""
    started = time.perf_counter()
    layouts: list[Layout]
    if activation_layouts is not None:
        layouts = [(option.modes, option.cost) for option in activation_layouts]
    elif block_modes is not None:
        layouts = [(tuple(block_modes), activation_cost(model, hardware, block_modes))]
    else:
        layouts = [(None, None)]
    all_costs = list(_costs_by_size(model, hardware, chunk_size, optimizer_states))
    evaluated = 0
    fitting: list[Candidate] = []
    smallest: Candidate | None = None

    def device_fits(prediction: Prediction) -> bool:
        return prediction.peak_device_bytes * (1 + margin) <= device_budget

    host_room = host_budget - host_fixed

    def disk_fits(prediction: Prediction, cost: ActivationCost | None) -> bool:
        used = prediction.nvme_bytes + (cost.ssd_bytes if cost is not None else prediction.ssd_bytes)
        return disk_room is None or used <= disk_room

    def fits(prediction: Prediction) -> bool:
        return device_fits(prediction) and prediction.host_bytes <= host_room and disk_fits(prediction, None)

    # Layouts by the forward time they add: a layout's step is at least the all-kept step plus
    # that, so the scan of a chunk plan stops once it cannot beat the fastest fitting layout.
    # Among equally fast layouts the first wins: the one managing the fewest blocks.
    by_forward = sorted(
        layouts,
        key=lambda layout: (
            layout[1].forward_extra_s if layout[1] else 0.0,
            sum(1 for mode in layout[0] or () if mode != "keep"),
        ),
    )
    leanest = min(layouts, key=lambda layout: layout[1].peak_bytes if layout[1] else 0)

    def with_layout(
        costs: ChunkCosts, p: int, b: int, r: int, kept: Prediction, layout: Layout, nvme: int = 0
    ) -> Candidate:
        modes, cost = layout
        return Candidate(
            chunk_size=costs.chunk_size,
            num_chunks=costs.num_chunks,
            n_persist=p,
            n_buffer=b,
            n_replicate=r,
            n_optimizer=nvme,
            prediction=kept if cost is None else with_activations(kept, cost, hardware),
            block_modes=modes,
            activations=cost,
        )

    def kept_prediction(costs: ChunkCosts, p: int, b: int, r: int | None = None, nvme: int | None = None) -> Prediction:
        return predict(
            model,
            hardware,
            costs,
            n_persist=p,
            n_buffer=b,
            updates_after_norm=updates_after_norm,
            keeps_gradients=keeps_gradients,
            n_replicate=(n_replicate or 0) if r is None else r,
            n_optimizer=(n_optimizer or 0) if nvme is None else nvme,
        )

    nvme_hosts: dict[tuple[int, int], NvmeHosts] = {}

    def nvme_for(costs: ChunkCosts, p: int, kept: Prediction, cost: ActivationCost | None) -> int | None:
        """Auto: the fewest NVMe chunks that bring the plan's host memory within the room with
        this layout's (None: not even all of them; 0 where it fits already or is not auto)."""
        over = kept.host_bytes + (cost.host_bytes if cost is not None else 0) - host_room
        if n_optimizer is not None:  # hand-set: in ``kept`` already
            return n_optimizer if over <= 0 else None
        if over <= 0:
            return 0
        key = (costs.chunk_size, p)
        if key not in nvme_hosts:
            nvme_hosts[key] = NvmeHosts(costs, p, keeps_gradients=keeps_gradients)
        return nvme_hosts[key].fewest_saving(over)

    def replicate_options(costs: ChunkCosts, p: int, b: int) -> list[int]:
        """The replicated counts worth predicting at (p, b): the hand-set one; else none, and on
        several ranks the most that fit with the leanest layout (it only adds device memory)."""
        if n_replicate is not None or costs.world_size == 1 or p == 0:
            return [n_replicate or 0]
        low, high = 0, p
        while low < high:
            middle = (low + high + 1) // 2
            if layout_fits(kept_prediction(costs, p, b, middle), leanest[1]):
                low = middle
            else:
                high = middle - 1
        return [0] if low == 0 else [0, low]

    def layout_fits(kept: Prediction, cost: ActivationCost | None) -> bool:
        if cost is None:
            return fits(kept)
        peak, host = memory_with_activations(kept, cost)
        return peak * (1 + margin) <= device_budget and host <= host_room and disk_fits(kept, cost)

    def wears(candidate: Candidate) -> bool:
        """Its NVMe state writes more per day than ``max_writes_per_day``."""
        daily = writes_per_day(candidate.prediction.nvme_bytes, candidate.prediction.step_s)
        return max_writes_per_day is not None and daily > max_writes_per_day

    def evaluate(costs: ChunkCosts, p: int, b: int) -> tuple[Candidate, bool]:
        """The fastest layout and replicated count that fit at (p, b) (one within the write
        limit before any beyond it), True; or, when none fits, the one with the least device
        memory, False."""
        nonlocal evaluated
        fastest: Candidate | None = None
        options = replicate_options(costs, p, b)
        for r in options:
            evaluated += 1
            kept = kept_prediction(costs, p, b, r)
            with_nvme: dict[int, Prediction] = {n_optimizer or 0: kept}
            for layout in by_forward:
                cost = layout[1]
                if fastest is not None and cost is not None and not wears(fastest):
                    if kept.step_s + cost.forward_extra_s >= fastest.prediction.step_s:
                        break
                nvme = nvme_for(costs, p, kept, cost)
                if nvme is None:
                    continue
                if nvme not in with_nvme:
                    evaluated += 1
                    with_nvme[nvme] = kept_prediction(costs, p, b, r, nvme)
                if not layout_fits(with_nvme[nvme], cost):
                    continue
                if cost is not None:
                    evaluated += 1
                option = with_layout(costs, p, b, r, with_nvme[nvme], layout, nvme)
                if fastest is None or (wears(option), option.prediction.step_s) < (
                    wears(fastest),
                    fastest.prediction.step_s,
                ):
                    fastest = option
        if fastest is not None:
            return fastest, True
        return with_layout(costs, p, b, options[0], kept_prediction(costs, p, b, options[0]), leanest), False

    def fits_at(costs: ChunkCosts, p: int, b: int) -> bool:
        nonlocal evaluated
        evaluated += 1
        kept = kept_prediction(costs, p, b)
        for _, cost in layouts:
            nvme = nvme_for(costs, p, kept, cost)
            if nvme is not None and layout_fits(kept if nvme == 0 else kept_prediction(costs, p, b, None, nvme), cost):
                return True
        return False

    for costs in all_costs:
        n = costs.num_chunks
        if n_persist is not None and n_persist > n:
            continue  # another chunk size may give enough chunks; none does: nothing_fits says so
        most_saved = most_saved_by_persisting(costs)
        fewest = n_replicate or 0
        if fewest > (n if n_persist is None else n_persist):
            continue  # not that many persistent chunks at this size
        for p in range(fewest, n + 1) if n_persist is None else [n_persist]:
            if nvme_start(costs, n_optimizer or 0) < p:
                break  # fewer offloaded trainable chunks than n_optimizer: more persistent ones neither
            if p == n:
                buffer_range: Iterable[int] = [0]
            elif n_buffer is not None:
                buffer_range = [n_buffer] if n_buffer >= costs.need[p] else []
            else:
                most = n - p if extra_buffers is None else min(n - p, costs.need[p] + extra_buffers)
                buffer_range = buffer_candidates(costs.need[p], most, fits_with=partial(fits_at, costs, p))
            device_full = False
            for position, b in enumerate(buffer_range):
                candidate, fitted = evaluate(costs, p, b)
                if position == 0 and not fitted and (smallest is None or _memory(candidate) < _memory(smallest)):
                    smallest = candidate
                if not fitted:
                    # More buffers only need more device memory (host bytes do not change); when
                    # even the leanest layout overflows the device here, more persistent chunks
                    # cannot fit either.
                    device_full = position == 0 and not device_fits(candidate.prediction)
                    if device_full and p < n:
                        # A later n_persist can only fit if its chunks save enough over this one.
                        floor = candidate.prediction.peak_device_bytes - most_saved[p]
                        device_full = floor * (1 + margin) > device_budget
                    break
                if position == 0 and (smallest is None or _memory(candidate) < _memory(smallest)):
                    smallest = candidate
                fitting.append(candidate)
            if device_full:
                break  # the smallest plan at this n_persist does not fit: nor will larger ones
    elapsed = time.perf_counter() - started
    if not fitting:
        if smallest is None:
            # Not one plan has the hand-set knobs, whatever the budgets: say what would.
            conflict = chunk_knob_conflict(
                model.param_sizes,
                model.module_params,
                element_size=model.element_size,
                world_size=hardware.world_size,
                chunk_sizes=[costs.chunk_size for costs in all_costs],
                chunk_size_hand_set=chunk_size is not None,
                n_persist=n_persist,
                n_buffer=n_buffer,
            )
            raise NoPlanFitsError(
                conflict
                or "no plan can be formed with the hand-set knobs "
                + ", ".join(hand_set(chunk_size, n_persist, n_buffer))
            )
        raise NoPlanFitsError(
            nothing_fits(
                smallest,
                device_budget,
                host_budget,
                margin,
                hand_set=hand_set(chunk_size, n_persist, n_buffer),
                host_fixed=host_fixed,
            )
        )
    bucket = None if hardware.copies_overlap_compute else SHARED_CORES_CHUNK_BYTES
    ranked = _ranked(fitting, max_writes_per_day, bucket_bytes=bucket)
    best = ranked[0]
    return SearchResult(
        best=best,
        runners_up=tuple(ranked[1 : 1 + keep]),
        binding=layout_words(best)
        + binding(
            best,
            all_costs,
            model,
            hardware,
            device_budget,
            host_budget,
            margin,
            n_persist,
            n_buffer,
            best.activations,
        ),
        evaluated=evaluated,
        elapsed_s=elapsed,
    )


def _costs_by_size(
    model: ModelProfile, hardware: HardwareProfile, chunk_size: int | None, optimizer_states: int
) -> Iterable[ChunkCosts]:
    if chunk_size is not None:
        yield chunk_costs(model, hardware, chunk_size, optimizer_states=optimizer_states)
        return
    for size in search_chunk_bytes(model.param_sizes, model.element_size, hardware.world_size):
        try:
            yield chunk_costs(model, hardware, size, optimizer_states=optimizer_states)
        except ChunkTooSmallError:
            continue


def _ranked(
    candidates: list[Candidate], max_writes_per_day: float | None = None, *, bucket_bytes: int | None = None
) -> list[Candidate]:
    """Fastest first. Plans within ``SAME_SPEED`` of the fastest count as equally fast (the model
    is not that exact); among them the one with the fewest chunks' optimizer state on NVMe wins
    (the tier only where it pays), then the one keeping the largest share of chunks on the device
    (less traffic that could go wrong in ways the model does not see), then one that prefetches
    offloaded chunks over one that waits for each fetch (the same reason), then the one managing
    the fewest blocks' activations (the same reason), then (``bucket_bytes``: CPU) a chunk size
    within a factor of sqrt(2) of it and among those the least padded bytes, then less device
    memory, then larger chunks (fewer collectives). Plans whose
    NVMe writes exceed ``max_writes_per_day`` come after all the others, ranked the same way;
    when every plan does, the one writing least comes first."""
    if max_writes_per_day is not None:
        daily = [writes_per_day(c.prediction.nvme_bytes, c.prediction.step_s) for c in candidates]
        gentle = [c for c, rate in zip(candidates, daily, strict=True) if rate <= max_writes_per_day]
        if not gentle:  # every plan that fits wears the drive: the one writing least
            return sorted(_ranked(candidates, bucket_bytes=bucket_bytes), key=lambda c: c.prediction.nvme_bytes)
        if len(gentle) < len(candidates):
            wearing = [c for c, rate in zip(candidates, daily, strict=True) if rate > max_writes_per_day]
            return _ranked(gentle, bucket_bytes=bucket_bytes) + _ranked(wearing, bucket_bytes=bucket_bytes)
    by_speed = sorted(candidates, key=lambda c: (c.prediction.step_s, c.prediction.peak_device_bytes))
    fastest = by_speed[0].prediction.step_s
    tied = [c for c in by_speed if c.prediction.step_s <= fastest * (1 + SAME_SPEED)]
    tied.sort(
        key=lambda c: (
            c.n_optimizer,
            -c.n_persist / c.num_chunks,
            waits_for_fetches(c),
            managed(c),
            round(abs(math.log2(c.chunk_size / bucket_bytes))) if bucket_bytes else 0,
            c.num_chunks * c.chunk_size if bucket_bytes else 0,
            c.prediction.peak_device_bytes,
            -c.chunk_size,
        )
    )
    rest = [c for c in by_speed if c.prediction.step_s > fastest * (1 + SAME_SPEED)]
    return tied + rest


def _memory(candidate: Candidate) -> int:
    return candidate.prediction.peak_device_bytes
