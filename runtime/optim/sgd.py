"""SGD over one flat fp32 shard, as ``torch.optim.SGD`` updates separate parameters:

    d = g + wd * p                       (weight decay as L2, where wd > 0)
    buf = d                              (momentum > 0, the parameter's first update)
    buf = momentum * buf + (1 - dampening) * d      (later updates)
    d = d + momentum * buf  (nesterov)   or   d = buf
    p = p - lr * d

With momentum, one state tensor (the momentum buffer); without, none, as torch keeps none
(``OptimizerRule.for_momentum``).

Two mechanisms, each torch's own: every update but a segment's first runs torch's fused SGD
kernel over parameters aliasing the segments (as ShardAdamW runs fused AdamW: one pass over
memory, no temporaries), its momentum buffers pre-seeded with views of the flat buffer. A
segment's first update with momentum (the buffer starts as the gradient, undampened) runs as
``_foreach`` ops (foreach_shard.py): the fused kernel takes one "first step" flag for all its
parameters, where a shard's segments may differ (a parameter that had no gradient yet). A
segment's step count says which (0 before its first update), and a checkpoint restores it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from protrain.runtime.optim.foreach_shard import WORKSPACE_NUMEL, Batch, ForeachShard
from protrain.runtime.optim.rule import OptimizerHyper
from protrain.runtime.optim.shard import GroupValues, alias_segment, check_step_inputs, per_group, split_plan


class ShardSGD(ForeachShard):
    """SGD over one flat shard: ``states`` is (momentum_buffer,) where ``hyper.momentum`` > 0,
    else empty."""

    first_update_differs = True

    def __init__(
        self,
        master: torch.Tensor,
        segments: Sequence[tuple[int, int, float] | tuple[int, int, float, int]],
        *,
        hyper: OptimizerHyper,
        states: tuple[torch.Tensor, ...],
        workspace_numel: int = WORKSPACE_NUMEL,
    ) -> None:
        super().__init__(master, segments, hyper=hyper, states=states, workspace_numel=workspace_numel)
        self._params = [alias_segment(master, segment) for segment in self.segments]
        self._split_sizes, self._piece_of_segment = split_plan(self.segments, numel=master.numel())
        self._fused = self._build_fused() if self.segments else None

    @property
    def num_states(self) -> int:  # type: ignore[override]
        return 1 if self.hyper.momentum != 0.0 else 0

    @torch.no_grad()
    def step_(
        self,
        grad_flat: torch.Tensor,
        active: Sequence[bool],
        lr: GroupValues | None = None,
        *,
        copy_out: torch.Tensor | None = None,
    ) -> None:
        """First updates with momentum as ``_foreach`` ops, the others by the fused kernel."""
        check_step_inputs(self.master, len(self.segments), grad_flat, active, lr, copy_out, num_groups=len(self.lrs))
        lrs = self.lrs if lr is None else per_group(lr, len(self.lrs), "lr")
        with_buffer = self.hyper.momentum != 0.0
        counts = self.steps.tolist()
        first = [on and with_buffer and count == 0.0 for on, count in zip(active, counts, strict=True)]
        later = [on and not head for on, head in zip(active, first, strict=True)]
        if any(first):
            super().step_(grad_flat, first, lrs)  # counts these segments' steps too
        if any(later) and self._fused is not None:
            self._step_fused(self._fused, grad_flat, later, lrs)
            self.steps += torch.tensor(later, dtype=torch.float32)
        if copy_out is not None:
            copy_out.copy_(self.master)

    def _step_fused(
        self, optimizer: torch.optim.SGD, grad_flat: torch.Tensor, active: Sequence[bool], lrs: Sequence[float]
    ) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lrs[group["protrain_group"]]
        pieces = grad_flat.split_with_sizes(self._split_sizes)
        for param, piece, on in zip(self._params, self._piece_of_segment, active, strict=True):
            param.grad = pieces[piece] if on else None
        try:
            optimizer.step()
        finally:
            for param in self._params:  # views of the engine's gradient buffer: do not keep it alive
                param.grad = None

    def _build_fused(self) -> torch.optim.SGD:
        """One fused SGD over the aliasing parameters (a torch param group per parameter group
        and weight decay), its momentum buffers pre-seeded with views of the flat buffer."""
        by_group: dict[tuple[int, float], list[nn.Parameter]] = {}
        for param, segment in zip(self._params, self.segments, strict=True):
            by_group.setdefault((segment.group, segment.weight_decay), []).append(param)
        hyper = self.hyper
        groups = [
            {"params": members, "weight_decay": decay, "lr": self.lrs[group], "protrain_group": group}
            for (group, decay), members in by_group.items()
        ]
        optimizer = torch.optim.SGD(
            groups,
            lr=self.lrs[0],
            momentum=hyper.momentum,
            dampening=hyper.dampening,
            nesterov=hyper.nesterov,
            fused=True,
        )
        if hyper.momentum != 0.0:
            (buffer,) = self.states
            for param, segment in zip(self._params, self.segments, strict=True):
                optimizer.state[param] = {"momentum_buffer": buffer.narrow(0, segment.start, segment.numel)}
        return optimizer

    def _update(self, batch: Batch, grads: list[torch.Tensor], *, lr: float) -> None:
        """A first update (momentum > 0): the buffer starts as the decayed gradient."""
        momentum = self.hyper.momentum
        params = self.master_pieces(batch)
        step: list[torch.Tensor] | tuple[torch.Tensor, ...] = grads
        if batch.weight_decay != 0.0:
            step = torch._foreach_add(grads, params, alpha=batch.weight_decay)
        buffers = self.state_pieces(batch, 0)
        torch._foreach_copy_(buffers, step)
        step = torch._foreach_add(step, buffers, alpha=momentum) if self.hyper.nesterov else buffers
        torch._foreach_add_(params, step, alpha=-lr)
