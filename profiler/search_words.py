"""What the search says about its result: the constraint that keeps the best plan from being
faster, and, when no plan fits, by how much the smallest misses and what to change (split from
search.py, which finds the plans)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protrain.profiler.activation_cost import ActivationCost
from protrain.profiler.cost_model import ChunkCosts, predict
from protrain.profiler.profile import HardwareProfile, ModelProfile

if TYPE_CHECKING:
    from protrain.profiler.search import Candidate


def managed(candidate: Candidate) -> int:
    """Blocks whose activations leave the device or are recomputed."""
    modes = candidate.block_modes or ()
    return sum(1 for mode in modes if mode != "keep")


def waits_for_fetches(candidate: Candidate) -> bool:
    """Offloaded chunks with no spare buffer to prefetch into: compute waits for every fetch,
    and on several ranks for the slowest rank's share of it, which the cost model does not see
    (measured on 2 CPU ranks: a 37 MiB chunk's serial fetch waited 56 ms where the probe's rate
    predicts 18, while prefetched fetches of the same bytes exposed 3 ms in all)."""
    return candidate.n_persist < candidate.num_chunks and candidate.n_buffer < 2


def hand_set(chunk_size: int | None, n_persist: int | None, n_buffer: int | None) -> list[str]:
    named = {"memory.chunk_size": chunk_size, "memory.n_persist": n_persist, "memory.n_buffer": n_buffer}
    return [name for name, value in named.items() if value is not None]


def nothing_fits(
    smallest: Candidate,
    device_budget: int,
    host_budget: int,
    margin: float,
    *,
    hand_set: list[str],
    host_fixed: int = 0,
) -> str:
    p = smallest.prediction
    needed = int(p.peak_device_bytes * (1 + margin))
    fixed = f" (with hand-set {', '.join(hand_set)})" if hand_set else ""
    if needed > device_budget:
        return (
            f"no plan fits the device budget of {_size(device_budget)} per rank{fixed}: the smallest, "
            f"chunk_size {_size(smallest.chunk_size)} with n_persist={smallest.n_persist} and "
            f"n_buffer={smallest.n_buffer}, needs {_size(needed)} ({_size(needed - device_budget)} more), of "
            f"which saved activations {_size(p.activation_bytes)}, "
            f"transient peak {_size(p.transient_bytes)}, "
            f"chunk buffers {_size(p.buffer_bytes + p.gradient_buffer_bytes)}, persistent chunks "
            f"{_size(p.persistent_bytes)}"
            + (f", the math libraries' workspaces {_size(p.workspace_bytes)}" if p.workspace_bytes else "")
            + "; lower micro_batch_size (activations grow with it) or raise "
            + "memory.device_budget"
            + ("; or let the hand-set knobs be auto" if hand_set else "")
        )
    besides = (
        f" beside the {_size(host_fixed)} the process holds outside it (at start: the interpreter, "
        "torch, what the caller holds besides the model's parameters; an async save's staging)"
        if host_fixed
        else ""
    )
    return (
        f"no plan fits the host budget of {_size(host_budget)} per rank{fixed}: the offloaded model "
        f"state needs {_size(p.host_bytes)}{besides} ({_size(p.host_bytes + host_fixed - host_budget)} "
        "more); raise memory.host_budget or use more ranks (each holds 1/world of it)"
    )


def layout_words(best: Candidate) -> str:
    """The activation layout the plan chose, when it manages any block."""
    count = managed(best)
    if count == 0 or best.block_modes is None:
        return ""
    counts = ", ".join(
        f"{best.block_modes.count(mode)} {mode}" for mode in ("ssd", "swap", "checkpoint") if mode in best.block_modes
    )
    return f"activations of {count} of {len(best.block_modes)} blocks managed ({counts}); "


def binding(
    best: Candidate,
    all_costs: list[ChunkCosts],
    model: ModelProfile,
    hardware: HardwareProfile,
    device_budget: int,
    host_budget: int,
    margin: float,
    n_persist: int | None,
    n_buffer: int | None,
    activations: ActivationCost | None,
) -> str:
    if best.n_persist == best.num_chunks:
        return "nothing binds: every chunk stays on the device"
    if n_persist is not None:
        return f"memory.n_persist={n_persist} is set by hand"
    costs = next(c for c in all_costs if c.chunk_size == best.chunk_size)
    more = best.n_persist + 1
    buffers = costs.need[more] if more < costs.num_chunks else 0
    if n_buffer is not None and more < costs.num_chunks:
        buffers = n_buffer
    grown = predict(
        model,
        hardware,
        costs,
        n_persist=more,
        n_buffer=buffers,
        activations=activations,
        updates_after_norm=best.prediction.updates_after_norm,
        keeps_gradients=best.prediction.keeps_gradients,
    )
    needed = int(grown.peak_device_bytes * (1 + margin))
    if needed > device_budget:
        return (
            f"device memory: keeping one more chunk on the device (n_persist={more}) would need "
            f"{_size(needed)} of the {_size(device_budget)} budget"
        )
    return f"speed: more persistent chunks would not be faster (n_persist={more} predicts {grown.step_s:.3f} s)"


def _size(num_bytes: int | float) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.2f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.2f} TiB"
