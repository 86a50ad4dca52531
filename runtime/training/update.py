"""The end of an accumulation window: the update every rank decides alike.

One collective sums every rank's per-parameter gradient flags, the window's totals and the stop
flag (a stop signal that reached any rank stops every rank after this update). A non-finite loss
on any rank skips the update, or raises under ``on_nonfinite_loss: raise``. The global gradient
norm costs a pass over every gradient: it is taken when clipping or the fp16 overflow check
needs it (then also reported), as DeepSpeed does; fp16 gradients are unscaled first and an
overflow skips the update. Clipping scales the shards by ``torch.nn.utils.clip_grad_norm_``'s
coefficient. AdamW then runs on the shards of the parameters that got a gradient on some rank
(``torch.optim.AdamW`` skips the others). Under stream chaos a skipped update raises
(``stream_chaos.refuse_skipped_step``): NaN read through a missing wait must not pass for a
non-finite loss or an overflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from protrain.profiler.plan import UpdateMode
from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.config.settings import TrainingSettings
from protrain.runtime.config.spec import NonFiniteLossPolicy
from protrain.runtime.hw import stream_chaos
from protrain.runtime.hw.distributed import DistContext, all_reduce_sum_
from protrain.runtime.observability.console import StepRecord
from protrain.runtime.training.loss_scale import DynamicLossScaler
from protrain.runtime.training.state import TrainingState
from protrain.runtime.training.window import AccumulationWindow, Window


class NonFiniteLossError(FloatingPointError):
    """A non-finite loss under ``on_nonfinite_loss: raise``; raised on every rank alike."""


@dataclass(frozen=True, slots=True)
class WindowTotals:
    """A window summed over ranks."""

    active: torch.Tensor
    """Per parameter: whether it got a gradient on some rank."""
    loss_sum: float
    nonfinite: int
    """Non-finite losses, all ranks."""
    tokens: int
    samples: int
    stop: bool
    """A stop signal reached some rank."""


def sum_window(window: Window, chunks: ChunkManager, dist_ctx: DistContext, *, stop: bool) -> WindowTotals:
    """Every rank's share of the window, summed in one collective."""
    extras = window.totals(stop=stop)
    header = all_reduce_sum_(torch.cat([chunks.params_with_grad(), extras]), dist_ctx)
    loss_sum, nonfinite, tokens, samples, stopped = header[-len(extras) :].tolist()
    return WindowTotals(
        active=header[: -len(extras)] > 0,
        loss_sum=loss_sum,
        nonfinite=int(nonfinite),
        tokens=int(tokens),
        samples=int(samples),
        stop=stopped > 0,
    )


@dataclass(frozen=True, slots=True)
class WindowOutcome:
    """A closed window: its totals and what became of its update."""

    totals: WindowTotals
    updated: bool
    grad_norm: float | None
    lr: float
    """The top-level learning rate the update used."""
    loss: float
    """The window's mean loss over ranks (NaN when one was not finite)."""
    started_s: float
    """When its first training forward began, on the engine's clock."""

    def record(self, *, step: int, elapsed_s: float, loss_scale: float | None, waits: dict[str, float]) -> StepRecord:
        totals = self.totals
        return StepRecord(
            step=step,
            loss=self.loss,
            lr=self.lr,
            grad_norm=self.grad_norm,
            step_time_s=elapsed_s,
            tokens_per_s=totals.tokens / elapsed_s if elapsed_s > 0 else 0.0,
            skipped=not self.updated,
            loss_scale=loss_scale,
            waits=waits,
            tokens=totals.tokens,
            samples=totals.samples,
        )


def close_window(
    window: AccumulationWindow,
    state: TrainingState,
    settings: TrainingSettings,
    *,
    lrs: Sequence[float],
    stop: bool,
    clock: Callable[[], float],
) -> WindowOutcome:
    """Sum the window over ranks, update (or skip) and count it; a new window begins. ``stop``:
    a stop signal reached this rank; ``clock``: the engine's, read for a window never started."""
    progress = state.progress
    micro_batches, normalised = window.steps, window.totals.normalised
    totals = sum_window(window.totals, state.chunks, state.dist_ctx, stop=stop)
    progress.samples_consumed += totals.samples
    state.data_position.consume_window(micro_batches)
    started_s = window.restart().start_s or clock()
    losses_in_window = micro_batches * state.dist_ctx.world_size
    # A caller-normalised window's losses add up to its loss (one sum per rank to average).
    loss_divisor = state.dist_ctx.world_size if normalised else losses_in_window
    updated, grad_norm = update_shards(
        totals,
        chunks=state.chunks,
        settings=settings,
        loss_scaler=state.loss_scaler,
        lr=lrs,
        update_number=progress.global_step + 1,
        losses_in_window=losses_in_window,
    )
    if updated:
        progress.global_step += 1
    else:
        progress.skipped_steps += 1
    loss = float("nan") if totals.nonfinite else totals.loss_sum / loss_divisor
    return WindowOutcome(totals, updated, grad_norm, lrs[0], loss, started_s)


def abandon_window(window: AccumulationWindow, state: TrainingState) -> None:
    """A backward that failed (a full disk, a failed read, Ctrl-C) added part of a micro-batch to
    the window's gradients: a caller who catches the error and goes on must not train on them.
    The whole window is dropped (its earlier micro-batches too: they are the caller's to run
    again) and the next micro-batch starts a new window. Early CPU-Adam updates (clipping off)
    keep no undo state: after one the engine refuses to go on until a checkpoint is loaded."""
    chunks, progress = state.chunks, state.progress
    chunks.finish_speculation()
    if chunks.speculation_undoable():
        chunks.discard_speculation()
    else:
        progress.torn = (
            f"a backward failed in update {progress.global_step + 1} after some chunks had already been "
            "updated from it (early CPU-Adam updates keep no undo state when gradient clipping is "
            "off); the parameters are part-updated: load a checkpoint (engine.load_checkpoint) "
            "to go on"
        )
    chunks.zero_grad()
    progress.micro_step -= window.steps
    window.restart()


def update_shards(
    totals: WindowTotals,
    *,
    chunks: ChunkManager,
    settings: TrainingSettings,
    loss_scaler: DynamicLossScaler | None,
    lr: Sequence[float],
    update_number: int,
    losses_in_window: int,
) -> tuple[bool, float | None]:
    """Update the shards unless the window is skipped; gradients are zeroed either way.
    Returns (updated, the global gradient norm when it was taken)."""
    skipped = totals.nonfinite > 0
    if skipped:
        chunks.discard_speculation()
    if skipped and settings.on_nonfinite_loss is NonFiniteLossPolicy.RAISE:
        chunks.zero_grad()
        raise NonFiniteLossError(
            f"non-finite loss in {totals.nonfinite} of {losses_in_window} micro-batches of update "
            f"{update_number}; set on_nonfinite_loss: skip to skip such updates"
        )
    grad_norm: float | None = None
    factors: tuple[float, ...] = ()
    if not skipped and settings.gradient_clipping == 0 and loss_scaler is None:
        # Logged every update, as torchtitan and the Trainer log it: the shards' squares (or,
        # applied as they arrived, the squares the host worker took of each gradient).
        grad_norm = chunks.grad_norm()
    if not skipped and (settings.gradient_clipping > 0 or loss_scaler is not None):
        factored = chunks.update_mode is UpdateMode.TWO_PHASE or chunks.gradients_in_files
        if factored and (loss_scaler is None or _power_of_two(loss_scaler.scale)):
            grad_norm, factors = _norm_and_factors(chunks, loss_scaler, settings.gradient_clipping)
        else:
            grad_norm = _unscale_and_clip(chunks, loss_scaler, settings.gradient_clipping)
        if loss_scaler is not None:
            overflow = not math.isfinite(grad_norm)
            loss_scaler.update(overflow=overflow)
            skipped = overflow
    if not skipped:
        chunks.step(lr=lr, active=totals.active, grad_factors=factors)
    chunks.zero_grad()
    if skipped:
        # Every rank decided alike (the totals and the norm are global), so all raise.
        stream_chaos.refuse_skipped_step(
            f"non-finite loss in {totals.nonfinite} of {losses_in_window} micro-batches of update {update_number}"
            if totals.nonfinite
            else f"fp16 gradients overflowed in update {update_number} (gradient norm {grad_norm})"
        )
    return not skipped, grad_norm


def _power_of_two(value: float) -> bool:
    return value > 0 and math.frexp(value)[0] == 0.5


def _norm_and_factors(
    chunks: ChunkManager, loss_scaler: DynamicLossScaler | None, clip: float
) -> tuple[float, tuple[float, ...]]:
    """Two-phase: the global norm (after unscaling) from the squares the host worker took, and
    the factors each chunk's update multiplies its gradient by first: unscale, then clip (as
    ``_unscale_and_clip`` scales the shards, without a pass over them here). Taken only while
    the loss scale is a power of two (DynamicLossScaler's halving and doubling keep it one from
    the default start), so unscaling the norm is exact."""
    norm = chunks.grad_norm()
    factors: list[float] = []
    if loss_scaler is not None:
        inverse = 1.0 / loss_scaler.scale
        norm *= inverse
        factors.append(inverse)
    if clip > 0 and math.isfinite(norm):
        coefficient = clip / (norm + 1e-6)
        if coefficient < 1.0:
            factors.append(coefficient)
    return norm, tuple(factors)


def _unscale_and_clip(chunks: ChunkManager, loss_scaler: DynamicLossScaler | None, clip: float) -> float:
    """The global gradient norm (after unscaling), clipping the shards when ``clip`` > 0."""
    if loss_scaler is not None:
        chunks.scale_grads_(1.0 / loss_scaler.scale)
    norm = chunks.grad_norm()
    if clip > 0 and math.isfinite(norm):
        coefficient = clip / (norm + 1e-6)
        if coefficient < 1.0:
            # Updates made before the norm was known used unclipped gradients.
            chunks.discard_speculation()
            chunks.scale_grads_(coefficient)
    return norm
