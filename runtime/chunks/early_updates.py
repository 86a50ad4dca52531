"""What the host side of a step keeps of one window's early updates (optimizer.py): that the
window's last backward updates offloaded chunks as their gradients arrive (``Armed``), and each
early update made (``Speculation``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protrain.runtime.hw.device import DeviceEvent
from protrain.runtime.optim.shard import GroupValues


@dataclass(frozen=True, slots=True)
class Speculation:
    """An early update made this window: the per-segment activity it assumed."""

    active: list[bool]


@dataclass(frozen=True, slots=True)
class Armed:
    """This window's last backward updates early: at ``lr``, once the ranks agreed (``agreed``)
    that none had a non-finite loss (``any_nonfinite`` > 0 otherwise)."""

    lr: GroupValues
    agreed: DeviceEvent
    any_nonfinite: torch.Tensor
