"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2) over
one flat fp32 shard, with decoupled weight decay, exactly as the published rule reads:

    c = b1 * m + (1 - b1) * g
    p = p * (1 - lr * wd)
    p = p - lr * sign(c)
    m = b2 * m + (1 - b2) * g

One state tensor (the moment ``m``): 4 bytes per parameter less than Adam's two. Each product
and sum rounds on its own, in that order, so the update is bit-identical to those four lines
written over a separate parameter (the tests check it): the sign of ``c`` makes rounding
matter, since a ``c`` that nearly cancels could otherwise land on the other side of zero.
"""

from __future__ import annotations

import torch

from protrain.runtime.optim.foreach_shard import Batch, ForeachShard


class ShardLion(ForeachShard):
    """Lion over one flat shard; ``states`` is (exp_avg,). Each parameter group's betas are its
    (b1, b2); eps is not used."""

    num_states = 1

    def _update(self, batch: Batch, grads: list[torch.Tensor], *, lr: float) -> None:
        b1, b2 = self.betas[batch.group]
        params = self.master_pieces(batch)
        moments = self.state_pieces(batch, 0)
        direction = torch._foreach_mul(moments, b1)
        torch._foreach_add_(direction, torch._foreach_mul(grads, 1.0 - b1))
        torch._foreach_sign_(direction)
        if batch.weight_decay != 0.0:
            torch._foreach_mul_(params, 1.0 - lr * batch.weight_decay)
        # lr * sign(c) is exact (sign is -1, 0 or 1), so adding it scaled rounds once, as p - lr * sign(c) does.
        torch._foreach_add_(params, direction, alpha=-lr)
        del direction
        torch._foreach_mul_(moments, b2)
        torch._foreach_add_(moments, torch._foreach_mul(grads, 1.0 - b2))
