"""SGD over one flat fp32 shard, as ``torch.optim.SGD`` (its for-loop implementation) updates
separate parameters, op for op:

    d = g + wd * p                       (weight decay as L2, where wd > 0)
    buf = d                              (momentum > 0, the parameter's first update)
    buf = momentum * buf + (1 - dampening) * d      (later updates)
    d = d + momentum * buf  (nesterov)   or   d = buf
    p = p - lr * d

With momentum, one state tensor (the momentum buffer); without, none, as torch keeps none
(``OptimizerRule.for_momentum``). A segment's first update is the one its step count says
(0 before it), which a checkpoint restores with the buffer.
"""

from __future__ import annotations

import torch

from protrain.runtime.optim.foreach_shard import Batch, ForeachShard


class ShardSGD(ForeachShard):
    """SGD over one flat shard: ``states`` is (momentum_buffer,) where ``hyper.momentum`` > 0,
    else empty."""

    first_update_differs = True

    @property
    def num_states(self) -> int:  # type: ignore[override]
        return 1 if self.hyper.momentum != 0.0 else 0

    def _update(self, batch: Batch, grads: list[torch.Tensor], *, lr: float) -> None:
        momentum, dampening = self.hyper.momentum, self.hyper.dampening
        params = self.master_pieces(batch)
        step: list[torch.Tensor] | tuple[torch.Tensor, ...] = grads
        if batch.weight_decay != 0.0:
            step = torch._foreach_add(grads, params, alpha=batch.weight_decay)
        if momentum != 0.0:
            buffers = self.state_pieces(batch, 0)
            if batch.first:
                torch._foreach_copy_(buffers, step)
            else:
                torch._foreach_mul_(buffers, momentum)
                torch._foreach_add_(buffers, step, alpha=1.0 - dampening)
            step = torch._foreach_add(step, buffers, alpha=momentum) if self.hyper.nesterov else buffers
        torch._foreach_add_(params, step, alpha=-lr)
