"""The search's pruning, memory first (PAPERS.md "Search"): what lets it predict few plans yet keep
the one a brute-force search would find.

For one chunk size, device memory grows with ``n_buffer`` at fixed ``n_persist`` while step time
never does, so only the fewest buffers, one more, and the most that fit (found by bisection) are
predicted; and the smallest plan at ``n_persist + 1`` needs at most one buffer less than the
smallest at ``n_persist`` plus the chunk's persistent bytes, so the ``n_persist`` loop stops at
the first ``n_persist`` whose smallest plan does not fit by more than the most any later one can
save (usually nothing: a persistent chunk takes at least a buffer's bytes, except a frozen or a
small last chunk, whose copy holds only its used elements). Neither drops the fastest plan that
fits.
"""

from __future__ import annotations

from collections.abc import Callable

from protrain.profiler.cost_model import ChunkCosts


def buffer_candidates(low: int, high: int, *, fits_with: Callable[[int], bool]) -> list[int]:
    """Buffer counts worth predicting for one ``n_persist``. Step time never grows with more
    buffers (more chunks reused at the start of backward, prefetch from two on) and device
    memory only grows, so the fastest plan at this ``n_persist`` is the largest count that fits:
    found by bisection. The fewest (for the smallest plan and the memory-first pruning) and one
    more (the first that prefetches) are kept too, for the runners-up and equal-speed ties."""
    if low >= high or not fits_with(low):
        return list(range(low, high + 1))[:2]
    if fits_with(high):  # plenty of memory: no bisection needed
        return sorted({low, low + 1, high})
    lo, hi = low, high  # lo fits; find the largest that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits_with(mid):
            lo = mid
        else:
            hi = mid - 1
    return sorted({low, min(low + 1, lo), lo})


def most_saved_by_persisting(costs: ChunkCosts) -> list[int]:
    """For each ``n_persist`` p, the most device bytes any larger ``n_persist`` can need less
    than the smallest plan at p (0 when none can). Each further persistent chunk adds its bytes
    and frees at most one buffer; all of them persistent also frees the gradient buffer where
    gradients go straight into the shards. A chunk's persistent bytes are usually at least a
    buffer's, and then no later plan needs less; a frozen chunk's copy holds only its used
    elements, or a small last chunk, and then one may."""
    n = costs.num_chunks
    buffer = costs.chunk_numel * costs.element_size
    # growth[q]: what n_persist=q adds over n_persist=0, at the fewest buffers it could have.
    growth = [costs.persistent_bytes[q] - q * buffer for q in range(n + 1)]
    if costs.direct_grads_possible:
        growth[n] -= buffer
    lowest_after = [0] * (n + 1)
    running = growth[n]
    for q in range(n, 0, -1):
        running = min(running, growth[q])
        lowest_after[q - 1] = running
    return [max(0, growth[p] - lowest_after[p]) for p in range(n)] + [0]
