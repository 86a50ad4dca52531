"""Learning-rate schedules as pure functions of the number of updates already made."""

from __future__ import annotations

import math

import torch

from protrain.runtime.config.settings import ScheduleSettings
from protrain.runtime.config.spec import SchedulerType


def lr_factor(update_index: int, schedule: ScheduleSettings) -> float:
    """Multiplier of the peak lr for update number ``update_index`` (0 for the first update).

    Warmup is linear from 1/warmup_steps to 1 over the first ``warmup_steps`` updates. After it,
    ``constant`` stays at 1 and ``warmup_cosine`` follows a half cosine down to
    ``min_lr_ratio`` at ``total_steps`` and stays there.
    """
    warmup = schedule.warmup_steps
    if update_index < warmup:
        return (update_index + 1) / warmup
    if schedule.kind is SchedulerType.CONSTANT:
        return 1.0
    assert schedule.total_steps is not None, "validated by the spec"
    decay_steps = max(1, schedule.total_steps - warmup)
    progress = min(1.0, (update_index - warmup) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return schedule.min_lr_ratio + (1.0 - schedule.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: ScheduleSettings) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose lr for each update is ``lr * lr_factor(update)``; step it after each update."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda index: lr_factor(index, schedule))
