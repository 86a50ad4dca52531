"""Plain training settings taken from the spec once, in ``initialize``.

Components below ``initialize`` take these values, never the pydantic spec.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.spec import DEFAULT_MIN_LR_RATIO, NonFiniteLossPolicy, Precision, SchedulerType, Spec


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerSettings:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    no_decay: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleSettings:
    kind: SchedulerType
    warmup_steps: int
    total_steps: int | None
    min_lr_ratio: float


@dataclass(frozen=True, slots=True, kw_only=True)
class LossScaleSettings:
    initial: float
    growth_interval: int
    min_scale: float


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingSettings:
    seed: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    precision: Precision
    gradient_clipping: float
    """0.0 means off."""
    on_nonfinite_loss: NonFiniteLossPolicy
    optimizer: OptimizerSettings
    schedule: ScheduleSettings
    loss_scale: LossScaleSettings | None
    dist_timeout_s: float


def settings_from_spec(spec: Spec) -> TrainingSettings:
    scaling = spec.effective_loss_scaling
    return TrainingSettings(
        seed=spec.seed,
        micro_batch_size=spec.micro_batch_size,
        gradient_accumulation_steps=spec.gradient_accumulation_steps,
        precision=spec.precision,
        gradient_clipping=spec.gradient_clipping or 0.0,
        on_nonfinite_loss=spec.on_nonfinite_loss,
        optimizer=OptimizerSettings(
            lr=spec.optimizer.lr,
            betas=spec.optimizer.betas,
            eps=spec.optimizer.eps,
            weight_decay=spec.optimizer.weight_decay,
            no_decay=spec.optimizer.no_decay,
        ),
        schedule=ScheduleSettings(
            kind=spec.scheduler.type,
            warmup_steps=spec.scheduler.warmup_steps,
            total_steps=spec.scheduler.total_steps,
            min_lr_ratio=DEFAULT_MIN_LR_RATIO
            if spec.scheduler.min_lr_ratio is None
            else spec.scheduler.min_lr_ratio,
        ),
        loss_scale=None
        if scaling is None
        else LossScaleSettings(
            initial=scaling.initial, growth_interval=scaling.growth_interval, min_scale=scaling.min_scale
        ),
        dist_timeout_s=spec.launcher.dist_timeout_s,
    )
