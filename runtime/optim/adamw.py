"""AdamW (and Adam) over one flat fp32 chunk shard, with torch's fused kernel and torch's exact
semantics.

The chunk engine (DESIGN section 4) keeps, per non-persistent chunk shard, flat fp32 tensors in
host memory: the master parameters, the reduced gradient, and AdamW's ``exp_avg`` and
``exp_avg_sq``. :class:`ShardAdamW` updates such a shard in place as soon as its gradient has
reached the host, and optionally refreshes the compute-precision (bf16/fp16) copy that mixed
precision sends back to the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from protrain.runtime.optim.rule import OptimizerHyper
from protrain.runtime.optim.shard import (
    GroupValues,
    Segment,
    alias_segment,
    check_master,
    check_segments,
    check_step_inputs,
    per_group,
    split_plan,
)


class ShardAdamW:
    """``torch.optim.AdamW(fused=True)`` over the parameters that live in one flat fp32 shard.

    Semantics are exactly those of ``torch.optim.AdamW`` on separate parameters, segment by
    segment: each segment has its own weight decay and its own step count, takes the learning
    rate and betas of its parameter group (torch's param groups), and a segment marked
    inactive in a step (its parameter got no gradient) is skipped the way torch skips a
    parameter whose ``.grad is None``: no decay, no step-count increment, moments untouched.
    Segments may be listed in any order and need not cover the shard (padding is never touched);
    ``active`` and :meth:`step_counts` follow the order given.

    Mechanism (the library does the math; nothing here re-implements Adam):

    * Every segment is an ``nn.Parameter`` built with ``Tensor._make_subclass`` over a view of
      the flat master, so it shares the master's storage: the fused kernel's in-place writes land
      in the flat tensor the chunk engine owns (checked at construction).
    * One ``torch.optim.AdamW(fused=True)`` holds those parameters, one param group per distinct
      (parameter group, weight decay). Its per-parameter state is pre-seeded before the first
      step: ``exp_avg`` and ``exp_avg_sq`` are views of two flat moment tensors laid out like
      the master, ``step`` is a 0-d view of one float32 ``steps`` vector. torch initialises
      state lazily only when a parameter's state is empty, so it keeps using these tensors (the
      unit tests check it), and a shard's optimizer state stays three contiguous tensors that
      can be snapshotted, restored or saved with one copy each.
    * Each step, active segments get ``.grad`` = a view of the flat gradient, inactive ones
      ``None``; the grads are cleared again afterwards so no reference to the engine's gradient
      buffer outlives the step.

    Bit-exactness: torch's CPU kernel splits each tensor into 64-byte units across threads and
    only the last ``numel % vector_width`` elements of a tensor take its scalar path, so a view at
    any offset is computed exactly like a separate parameter of the same size: results are
    bit-identical to ``torch.optim.AdamW(fused=True)``, and within rounding of the default
    (for-loop) implementation.

    Why the optimizer rather than ``torch._fused_adamw_`` on lists of views: the kernel is memory
    bound, the optimizer's bookkeeping does not show for real shards, and a private op is not worth
    depending on (docs/decisions/0002-shard-adamw-wraps-the-optimizer.md).

    ``copy_out`` is refreshed by one ``copy_`` over the whole shard after the update. Doing it in
    the same pass, a cache-sized block at a time, was no faster; a real single pass would need a
    kernel of our own, which this module avoids (docs/decisions/0003-copy-out-after-the-update.md).

    Threads: the kernel opens one parallel region per segment, even a tiny one, and such regions
    are slow when the cores are oversubscribed. ``torch.set_num_threads`` called in a worker thread
    leaves the main thread's count alone, so the engine gives the update thread fewer threads
    (docs/decisions/0004-worker-thread-counts.md).

    Nothing here is CPU-specific (the fused kernel also exists on CUDA, with the step tensors on
    the master's device), but only the CPU path is tested.
    """

    torch_optimizer: ClassVar[type[torch.optim.AdamW] | type[torch.optim.Adam]] = torch.optim.AdamW
    """The torch optimizer whose fused kernel updates the shard."""

    def __init__(
        self,
        master: torch.Tensor,  # (numel,) fp32, contiguous: updated in place
        segments: Sequence[tuple[int, int, float] | tuple[int, int, float, int]],
        *,
        lr: GroupValues,
        betas: tuple[float, float] | Sequence[tuple[float, float]] = (0.9, 0.999),
        eps: float = 1e-8,
        moments: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``lr`` and ``betas``: one value for every segment, or one per parameter group
        (``Segment.group`` indexes them). ``moments``: zero-filled (exp_avg, exp_avg_sq) shaped
        like ``master`` when the caller owns their memory (the chunk engine puts offloaded
        shards' moments in its host arena)."""
        check_master(master)
        self.segments: tuple[Segment, ...] = check_segments(segments, numel=master.numel())
        num_groups = 1 + max((s.group for s in self.segments), default=0)
        self.lr = per_group(lr, num_groups, "lr")
        self.betas = _per_group_betas(betas, num_groups)
        for group_lr, group_betas in zip(self.lr, self.betas, strict=True):
            _check_hyperparameters(lr=group_lr, betas=group_betas, eps=eps)
        self.master = master
        if moments is None:
            moments = (torch.zeros_like(master), torch.zeros_like(master))
        for moment in moments:
            if moment.shape != master.shape or moment.dtype != master.dtype or moment.device != master.device:
                raise ValueError("moments must have the master's shape, dtype and device")
        self.exp_avg, self.exp_avg_sq = moments
        # float32 because that is the dtype torch's fused AdamW keeps `step` in and reads it
        # from; exact for counts up to 2**24, as in torch itself.
        self.steps = torch.zeros(len(self.segments), dtype=torch.float32, device=master.device)
        self._params = [alias_segment(master, segment) for segment in self.segments]
        self._split_sizes, self._piece_of_segment = split_plan(self.segments, numel=master.numel())
        # A rank's shard can be all padding (no segment); torch refuses an empty optimizer.
        self._optimizer = _build_optimizer(self._params, self, eps=eps) if self.segments else None

    @property
    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq), flat, in ``ADAMW.state_names`` order."""
        return (self.exp_avg, self.exp_avg_sq)

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    def step_counts(self) -> list[int]:
        """Per-segment number of updates taken (torch's ``state['step']``)."""
        return [int(step) for step in self.steps.tolist()]

    @torch.no_grad()
    def step_(
        self,
        grad_flat: torch.Tensor,  # (numel,) fp32, same device as the master; read only
        active: Sequence[bool],  # (num_segments,): False = the parameter got no gradient
        lr: GroupValues | None = None,
        *,
        copy_out: torch.Tensor | None = None,  # (numel,) bf16/fp16/fp32, overwritten
    ) -> None:
        """One AdamW step of the active segments, in place on the master and the moments.

        ``lr`` (one for all groups, or one per group) applies to this step only (a scheduler's
        values); ``None`` uses the constructor's.
        ``copy_out``, when given, is set to ``master.to(copy_out.dtype)`` after the update, over
        the whole shard, so it always mirrors the master (inactive segments included).
        """
        check_step_inputs(self.master, len(self.segments), grad_flat, active, lr, copy_out, num_groups=len(self.lr))
        if self._optimizer is not None:
            lrs = self.lr if lr is None else per_group(lr, len(self.lr), "lr")
            self._update(self._optimizer, grad_flat, active, lrs)
        if copy_out is not None:
            copy_out.copy_(self.master)

    def _update(
        self,
        optimizer: torch.optim.Optimizer,
        grad_flat: torch.Tensor,
        active: Sequence[bool],
        lrs: Sequence[float],
    ) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lrs[group["protrain_group"]]
        # One split call makes every segment's gradient view (a narrow per segment costs ~5x more).
        pieces = grad_flat.split_with_sizes(self._split_sizes)
        for param, piece, is_active in zip(self._params, self._piece_of_segment, active, strict=True):
            param.grad = pieces[piece] if is_active else None
        try:
            optimizer.step()
        finally:
            # The grads are views of the engine's gradient buffer: do not keep it alive.
            for param in self._params:
                param.grad = None

    def state_dict(self) -> dict[str, Any]:
        """Per segment: its place, its step count and views of its moments.

        Like ``torch.optim.Optimizer.state_dict`` the tensors alias the live state (no copy of
        two shard-sized tensors); clone or serialise them before the next step if a snapshot is
        needed.
        """
        steps = self.step_counts()
        return {
            "segments": [
                {
                    "start": segment.start,
                    "numel": segment.numel,
                    "weight_decay": segment.weight_decay,
                    "group": segment.group,
                    "step": steps[index],
                    "exp_avg": self.exp_avg.narrow(0, segment.start, segment.numel),
                    "exp_avg_sq": self.exp_avg_sq.narrow(0, segment.start, segment.numel),
                }
                for index, segment in enumerate(self.segments)
            ]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy a :meth:`state_dict` of a shard with the same segments into this one."""
        entries = state["segments"]
        if len(entries) != len(self.segments):
            raise ValueError(
                f"state has {len(entries)} segments, this shard {len(self.segments)}: load the "
                "state saved from the same chunk layout"
            )
        for index, (entry, segment) in enumerate(zip(entries, self.segments, strict=True)):
            saved = Segment(
                int(entry["start"]),
                int(entry["numel"]),
                float(entry["weight_decay"]),
                int(entry.get("group", 0)),
            )
            if saved != segment:
                raise ValueError(
                    f"segment {index}: state has {saved}, this shard {segment}: load the state "
                    "saved from the same chunk layout"
                )
        with torch.no_grad():
            for index, (entry, segment) in enumerate(zip(entries, self.segments, strict=True)):
                self.exp_avg.narrow(0, segment.start, segment.numel).copy_(entry["exp_avg"])
                self.exp_avg_sq.narrow(0, segment.start, segment.numel).copy_(entry["exp_avg_sq"])
                self.steps[index] = float(entry["step"])


def _per_group_betas(
    betas: tuple[float, float] | Sequence[tuple[float, float]], num_groups: int
) -> tuple[tuple[float, float], ...]:
    if len(betas) == 2 and all(isinstance(b, int | float) for b in betas):
        pair = (float(betas[0]), float(betas[1]))  # type: ignore[arg-type]
        return (pair,) * num_groups
    pairs = tuple((float(b[0]), float(b[1])) for b in betas)  # type: ignore[index]
    if len(pairs) < num_groups:
        raise ValueError(f"betas has {len(pairs)} pairs for {num_groups} parameter groups")
    return pairs


def _check_hyperparameters(*, lr: float, betas: tuple[float, float], eps: float) -> None:
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"betas must lie in [0, 1), got {betas}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def _build_optimizer(params: list[nn.Parameter], shard: ShardAdamW, *, eps: float) -> torch.optim.Optimizer:
    """One fused AdamW (or Adam) over the aliasing parameters (a torch param group per parameter group and
    weight decay), its state pre-seeded with views of the shard's flat moments and step vector."""
    by_group: dict[tuple[int, float], list[nn.Parameter]] = {}
    for param, segment in zip(params, shard.segments, strict=True):
        by_group.setdefault((segment.group, segment.weight_decay), []).append(param)
    groups = [
        {
            "params": members,
            "weight_decay": decay,
            "lr": shard.lr[group],
            "betas": shard.betas[group],
            "protrain_group": group,
        }
        for (group, decay), members in by_group.items()
    ]
    optimizer = type(shard).torch_optimizer(groups, lr=shard.lr[0], eps=eps, fused=True)
    for index, (param, segment) in enumerate(zip(params, shard.segments, strict=True)):
        # Non-empty state: torch skips its lazy initialisation and updates these views.
        optimizer.state[param] = {
            "step": shard.steps[index],
            "exp_avg": shard.exp_avg.narrow(0, segment.start, segment.numel),
            "exp_avg_sq": shard.exp_avg_sq.narrow(0, segment.start, segment.numel),
        }
    return optimizer


def build_adamw(
    master: torch.Tensor,
    segments: Sequence[tuple[int, int, float, int]],
    *,
    hyper: OptimizerHyper,
    states: tuple[torch.Tensor, ...],
) -> ShardAdamW:
    """AdamW's kernel for ``ADAMW`` (registry.py): the shard's moments are ``states``."""
    exp_avg, exp_avg_sq = states
    return ShardAdamW(master, segments, lr=hyper.lrs, betas=hyper.betas, eps=hyper.eps, moments=(exp_avg, exp_avg_sq))


class ShardAdam(ShardAdamW):
    """``torch.optim.Adam(fused=True)`` over one flat shard, by the same mechanism as
    :class:`ShardAdamW`: weight decay is L2, added to the gradient before the moments (Adam's),
    not decoupled (AdamW's)."""

    torch_optimizer = torch.optim.Adam


def build_adam(
    master: torch.Tensor,
    segments: Sequence[tuple[int, int, float, int]],
    *,
    hyper: OptimizerHyper,
    states: tuple[torch.Tensor, ...],
) -> ShardAdam:
    """Adam's kernel for ``ADAM`` (registry.py)."""
    exp_avg, exp_avg_sq = states
    return ShardAdam(master, segments, lr=hyper.lrs, betas=hyper.betas, eps=hyper.eps, moments=(exp_avg, exp_avg_sq))
