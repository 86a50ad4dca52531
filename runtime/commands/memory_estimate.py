"""The memory estimator: what each way of placing a model needs on a machine, per rank, from the
cost model over an analytic profile (``protrain-run --what-if``; no weights, no torch).

Like DeepSpeed's ``estimate_zero3_model_states_mem_needs_all_live``, one row per placement of the
model state (every chunk on the device, or every chunk on the host streamed through device
buffers) and of the activations (every block kept, swapped to host, recomputed, or on SSD when the
hardware file has a disk), but with the activations, the transient peak, host and SSD bytes and
the predicted step time counted, and whether each fits this machine's budgets. The searched plan
(what ``protrain-run`` would run) mixes them; it is printed beside the rows.

Each row takes the chunk size of the search's grid that needs the fewest device and host bytes
together (ties: the faster), and an offloaded row the fewest device buffers that still prefetch
(two, or more where one module spans more chunks): the least the placement needs, not a tuned
plan (the search's plan, which may keep some chunks on the device, is the tuned one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich import box
from rich.table import Table

from protrain.profiler.activation_cost import CHECKPOINT, KEEP, SSD, SWAP, ActivationCost, activation_cost
from protrain.profiler.chunking import ChunkTooSmallError, search_chunk_bytes
from protrain.profiler.cost_model import ChunkCosts, Prediction, chunk_costs, predict
from protrain.profiler.host_bytes import ADAMW_STATES
from protrain.profiler.plan import Plan
from protrain.profiler.profile import HardwareProfile, ModelProfile
from protrain.profiler.search import MEMORY_MARGIN

ACTIVATION_WORDS = {KEEP: "kept", SWAP: "to host", CHECKPOINT: "recomputed", SSD: "to SSD"}
PREFETCH_BUFFERS = 2
"""Device buffers with which the next chunk's fetch overlaps the current chunk's compute."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EstimateRow:
    """One placement's needs (bytes per rank) and predicted step time."""

    offloaded: bool
    """Every chunk on the host, streamed through ``n_buffer`` device buffers (else all resident)."""
    mode: str
    """Every block's activation mode (``profiler.activation_cost.MODES``)."""
    chunk_size: int
    n_persist: int
    num_chunks: int
    n_buffer: int
    device_bytes: int
    """Predicted peak device bytes (before the search's margin)."""
    state_bytes: int
    """Of those, the model state: persistent chunks and chunk buffers."""
    activation_bytes: int
    """Of those, saved activations at their peak."""
    host_bytes: int
    ssd_bytes: int
    step_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Budgets:
    device: int
    host: int


def estimate_rows(
    model: ModelProfile,
    hardware: HardwareProfile,
    *,
    updates_after_norm: bool = False,
    keeps_gradients: bool = True,
    optimizer_states: int = ADAMW_STATES,
) -> list[EstimateRow]:
    """Every placement of model state x activations (SSD only when ``hardware`` has disk
    rates), resident rows first; ``updates_after_norm`` and ``keeps_gradients`` as for
    ``profiler.cost_model.predict``, ``optimizer_states`` the optimizer rule's state tensors."""
    sizes = _chunk_costs(model, hardware, optimizer_states)
    has_disk = hardware.ssd_write_bytes_per_s > 0 and hardware.ssd_read_bytes_per_s > 0
    modes = [KEEP, SWAP, CHECKPOINT] + ([SSD] if has_disk and model.blocks else [])
    rows = []
    for offloaded in (False, True):
        for mode in modes:
            cost = None if mode == KEEP else activation_cost(model, hardware, [mode] * len(model.blocks))
            rows.append(
                _leanest(
                    model,
                    hardware,
                    sizes,
                    offloaded=offloaded,
                    mode=mode,
                    cost=cost,
                    updates_after_norm=updates_after_norm,
                    keeps_gradients=keeps_gradients,
                )
            )
    return rows


def fits_text(device_bytes: int, host_bytes: int, budgets: Budgets) -> str:
    """Whether the bytes fit the budgets, the device's with the search's margin: "yes", or which
    budget is short ("no: device", "no: host", "no: both")."""
    device_short = device_bytes * (1 + MEMORY_MARGIN) > budgets.device  # as the search checks it
    host_short = host_bytes > budgets.host
    if device_short and host_short:
        return "no: both"
    return "no: device" if device_short else "no: host" if host_short else "yes"


def estimate_table(rows: Sequence[EstimateRow], plan: Plan | None, budgets: Budgets, *, title: str) -> Table:
    """The rows and, when one fits, the searched plan as the last row (bold). Bytes in GiB per
    rank, so the columns stay narrow enough for a terminal."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("model state", "activations", "device", "host", "SSD", "step s", "fits"):
        right = column in ("device", "host", "SSD", "step s")
        # Figures never wrap; the words do, in a narrow terminal.
        table.add_column(
            column,
            justify="right" if right else "left",
            no_wrap=right or column == "fits",
            min_width=len("host (2 buffers)") if column == "model state" else None,
        )
    for row in rows:
        table.add_row(
            f"host ({row.n_buffer} buffers)" if row.offloaded else "device",
            ACTIVATION_WORDS[row.mode],
            *_figures(row.device_bytes, row.host_bytes, row.ssd_bytes, row.step_s, budgets),
        )
    if plan is not None and plan.predicted_step_s is not None:
        table.add_section()
        table.add_row(
            f"search: {plan.n_persist}/{plan.num_chunks} on device",
            _modes_text(plan),
            *_figures(
                plan.predicted_peak_device_bytes or 0,
                plan.predicted_peak_host_bytes or 0,
                plan.predicted_ssd_bytes or 0,
                plan.predicted_step_s,
                budgets,
            ),
            style="bold",
        )
    return table


def _figures(device: int, host: int, ssd: int, step_s: float, budgets: Budgets) -> tuple[str, ...]:
    fits = fits_text(device, host, budgets)
    return (
        _number(device),
        _number(host),
        _number(ssd) if ssd else "-",
        f"{step_s:.2f}",
        f"[green]{fits}[/green]" if fits == "yes" else f"[red]{fits}[/red]",
    )


def needs_summary(
    rows: Sequence[EstimateRow],
    model: ModelProfile,
    parameters: int,
    *,
    keeps_gradients: bool = True,
    optimizer: str = "two Adam moments",
) -> str:
    """Model state and activations in a sentence, read from the rows (so it agrees with them)."""
    by_key = {(row.offloaded, row.mode): row for row in rows}
    resident, offloaded, recomputed = by_key[False, KEEP], by_key[True, KEEP], by_key[False, CHECKPOINT]
    batch = " x ".join(str(dim) for dim in model.batch_shape)
    frozen = sum(numel for numel, trainable in model.param_sizes if not trainable)
    frozen_words = (
        f" ({frozen / 1e9:.2f}B frozen: one {model.precision} copy each, no gradient or optimizer state)"
        if frozen
        else ""
    )
    return (
        f"{parameters / 1e9:.2f}B parameters in {model.precision}{frozen_words}. Model state: "
        f"{_gib(resident.state_bytes)} on the device when resident (compute copy, fp32 master, "
        f"gradient, {optimizer}), {_gib(offloaded.host_bytes)} on the host when offloaded "
        f"({'with' if keeps_gradients else 'without'} a gradient shard, and staging). "
        f"Saved activations of one {batch} micro-batch: {_gib(resident.activation_bytes)} kept, "
        f"{_gib(recomputed.activation_bytes)} at their peak when every block is recomputed. "
        f"Transient peak beyond them: {_gib(model.transient_bytes)}."
    )


def _leanest(
    model: ModelProfile,
    hardware: HardwareProfile,
    sizes: Sequence[ChunkCosts],
    *,
    offloaded: bool,
    mode: str,
    cost: ActivationCost | None,
    updates_after_norm: bool,
    keeps_gradients: bool,
) -> EstimateRow:
    best: tuple[ChunkCosts, int, int, Prediction] | None = None
    for costs in sizes:
        n = costs.num_chunks
        n_persist = 0 if offloaded else n
        n_buffer = max(costs.need[0], min(PREFETCH_BUFFERS, n)) if offloaded else 0
        prediction = predict(
            model,
            hardware,
            costs,
            n_persist=n_persist,
            n_buffer=n_buffer,
            activations=cost,
            updates_after_norm=updates_after_norm,
            keeps_gradients=keeps_gradients,
        )
        if best is None or _need(prediction) < _need(best[3]):
            best = (costs, n_persist, n_buffer, prediction)
    assert best is not None, "the chunk-size grid is never empty"
    costs, n_persist, n_buffer, prediction = best
    return EstimateRow(
        offloaded=offloaded,
        mode=mode,
        chunk_size=costs.chunk_size,
        n_persist=n_persist,
        num_chunks=costs.num_chunks,
        n_buffer=n_buffer,
        device_bytes=prediction.peak_device_bytes,
        state_bytes=prediction.persistent_bytes + prediction.buffer_bytes,
        activation_bytes=prediction.activation_bytes,
        host_bytes=prediction.host_bytes,
        ssd_bytes=prediction.ssd_bytes,
        step_s=prediction.step_s,
    )


def _need(prediction: Prediction) -> tuple[int, float]:
    """Device and host bytes together, then time: a chunk size that pads less needs less host
    memory, one that is smaller needs smaller device buffers; the row takes the least in all."""
    return prediction.peak_device_bytes + prediction.host_bytes, prediction.step_s


def _chunk_costs(model: ModelProfile, hardware: HardwareProfile, optimizer_states: int) -> list[ChunkCosts]:
    """The per-chunk terms at every chunk size of the search's grid."""
    sizes = []
    for size in search_chunk_bytes(model.param_sizes, model.element_size, hardware.world_size):
        try:
            sizes.append(chunk_costs(model, hardware, size, optimizer_states=optimizer_states))
        except ChunkTooSmallError:
            continue
    return sizes


def _modes_text(plan: Plan) -> str:
    counts = {mode.value: plan.block_modes.count(mode) for mode in dict.fromkeys(plan.block_modes)}
    return ", ".join(f"{count} {mode}" for mode, count in counts.items()) or "(no blocks)"


def _number(num_bytes: int) -> str:
    """GiB without the unit, for the table's columns (their headers name it)."""
    return f"{num_bytes / 2**30:,.1f}"


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.1f} GiB"
