"""Plain settings taken from the spec once, in ``initialize``: the training settings (what the
Engine and the chunk engine follow) and the planning settings (what the Planner, the budgets and
``apply_plan`` read).

Components below ``initialize`` take these values, never the pydantic spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from protrain.profiler.plan_builder import KnobRequest
from protrain.runtime.config.spec import (
    AUTO,
    DEFAULT_MIN_LR_RATIO,
    LoggingSpec,
    MemorySpec,
    NonFiniteLossPolicy,
    Precision,
    SchedulerType,
    Spec,
    auto_fields,
)
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.config.spec_types import Auto, ParamGroup
from protrain.runtime.optim.registry import rule_named

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerSettings:
    type: str
    """The rule's name (runtime/optim/registry.py)."""
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    no_decay: tuple[str, ...]
    groups: tuple[ParamGroup, ...] = ()
    """``optimizer.groups`` in order (runtime/param_groups.py resolves them per parameter)."""
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    """SGD's (0, 0, False for the others)."""


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
class TraceSettings:
    start_step: int
    """The first optimizer update traced (1: the first)."""
    steps: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LoggingSettings:
    """``logging``: where rank 0 sends each update's metrics besides metrics.jsonl."""

    level: str = "info"
    """quiet, info or debug: what rank 0 prints (runtime.observability.console.ProgressReporter)."""
    every_steps: int = 1
    """The trackers get update 1 and every this many updates (metrics.jsonl gets every one)."""
    tensorboard: bool = False
    wandb_project: str | None = None
    """None: no W&B."""
    wandb_name: str | None = None
    trace: TraceSettings | None = None


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
    logging: LoggingSettings = LoggingSettings()

    @property
    def keeps_gradients(self) -> bool:
        """Whether offloaded chunks keep an fp32 gradient shard (see ``keeps_gradients``)."""
        return keeps_gradients(
            gradient_clipping=self.gradient_clipping,
            loss_scaled=self.loss_scale is not None,
            accumulation_steps=self.gradient_accumulation_steps,
        )


def keeps_gradients(*, gradient_clipping: float, loss_scaled: bool, accumulation_steps: int) -> bool:
    """Whether a gradient must be kept after it arrives: until the global norm is known
    (clipping, the fp16 loss scale's overflow check) or across micro-batches (accumulation).
    Otherwise offloaded chunks keep no gradient shard: each reduced gradient is applied by CPU
    Adam as it arrives (12 host bytes per parameter instead of 16; profiler/host_bytes.py)."""
    return gradient_clipping > 0 or loss_scaled or accumulation_steps > 1


def trainer_set(value: T | Auto, key: str) -> T:
    """The value of training field ``key``. "auto" there is the Trainer integration's to fill
    (``spec_types.TrainerFilled``); ``initialize`` refuses a spec still holding one first
    (``refuse_trainer_autos``), so reaching one here is a caller's bug, told as that refusal."""
    if value == AUTO:
        raise SpecError(f'{key}: "auto" here is filled from TrainingArguments by ProTrainTrainer only; set a value')
    return value


def settings_from_spec(spec: Spec) -> TrainingSettings:
    """The training settings; SpecError where a training field is still "auto"."""
    scaling = spec.effective_loss_scaling
    optimizer = spec.optimizer
    return TrainingSettings(
        seed=trainer_set(spec.seed, "seed"),
        micro_batch_size=trainer_set(spec.micro_batch_size, "micro_batch_size"),
        gradient_accumulation_steps=trainer_set(spec.gradient_accumulation_steps, "gradient_accumulation_steps"),
        precision=trainer_set(spec.precision, "precision"),
        gradient_clipping=_clipping(spec),
        on_nonfinite_loss=spec.on_nonfinite_loss,
        optimizer=OptimizerSettings(
            type=optimizer.type,
            lr=trainer_set(optimizer.lr, "optimizer.lr"),
            betas=trainer_set(optimizer.betas, "optimizer.betas"),
            eps=trainer_set(optimizer.eps, "optimizer.eps"),
            weight_decay=trainer_set(optimizer.weight_decay, "optimizer.weight_decay"),
            no_decay=spec.optimizer.no_decay,
            groups=spec.optimizer.groups,
            momentum=optimizer.momentum,
            dampening=optimizer.dampening,
            nesterov=optimizer.nesterov,
        ),
        schedule=ScheduleSettings(
            kind=spec.scheduler.type,
            warmup_steps=spec.scheduler.warmup_steps,
            total_steps=spec.scheduler.total_steps,
            min_lr_ratio=DEFAULT_MIN_LR_RATIO if spec.scheduler.min_lr_ratio is None else spec.scheduler.min_lr_ratio,
        ),
        loss_scale=None
        if scaling is None
        else LossScaleSettings(
            initial=scaling.initial, growth_interval=scaling.growth_interval, min_scale=scaling.min_scale
        ),
        dist_timeout_s=spec.launcher.dist_timeout_s,
        logging=logging_settings(spec.logging),
    )


def logging_settings(section: LoggingSpec) -> LoggingSettings:
    wandb, trace = section.wandb, section.trace
    return LoggingSettings(
        level=section.level.value,
        every_steps=section.every_steps,
        tensorboard=section.tensorboard,
        wandb_project=None if wandb is None else wandb.project,
        wandb_name=None if wandb is None else wandb.name,
        trace=None if trace is None else TraceSettings(start_step=trace.start_step, steps=trace.steps),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanningSettings:
    """The spec's memory and profiler sections, and what planning reads of the rest."""

    precision: Precision
    micro_batch_size: int
    request: KnobRequest
    """The memory knobs: a number where set by hand, None where "auto"."""
    chosen: tuple[str, ...]
    """The ``memory.*`` keys left "auto" (the plan table says the planner chose them)."""
    blocks_path: str | None
    """``memory.blocks``: the module path of the block list; None finds it."""
    ssd_path: Path | None
    """``memory.ssd.path``, expanded; None: no SSD tier."""
    checkpoint_dir: Path | None = None
    """``checkpoint.dir``, expanded: where the NVMe tier's disk may hold checkpoints too."""
    checkpoints_kept: int = 0
    """``checkpoint.keep_last``."""
    max_nvme_writes_per_day: int | None = None
    """``memory.ssd.max_writes_per_day``: the NVMe tier's write rate the planner prefers to stay under."""
    device_budget_bytes: int | None
    """Per rank; None: "auto" (measured, see ``runtime.planning.budgets``)."""
    host_budget_bytes: int | None
    cache_dir: Path
    """``profiler.cache_dir``, expanded."""
    warmup_steps: int
    profile_steps: int
    updates_after_norm: bool = False
    """Gradient clipping or fp16: no chunk is updated before the global norm is known, which
    the cost model times differently (profiler.cost_model)."""
    keeps_gradients: bool = True
    """Offloaded chunks keep an fp32 gradient shard on the host (``keeps_gradients``), which
    the cost model counts."""
    async_save: bool = False
    """``checkpoint.async_save``: a save copies this rank's state to host memory first, which
    the plan's host figure counts."""
    optimizer: str = "adamw"
    """``optimizer.type``: the rule (runtime/optim/) whose state the plan's memory counts."""
    optimizer_momentum: float = 0.0
    """``optimizer.momentum``: SGD keeps its momentum buffer only when it is > 0."""

    @property
    def optimizer_states(self) -> int:
        """fp32 state tensors per trainable element (the rule's ``state_names``)."""
        return len(rule_named(self.optimizer).for_momentum(self.optimizer_momentum).state_names)


def _clipping(spec: Spec) -> float:
    """``gradient_clipping``: 0.0 when off (0 or null)."""
    return trainer_set(spec.gradient_clipping, "gradient_clipping") or 0.0


def planning_settings_from_spec(spec: Spec) -> PlanningSettings:
    """The planning settings; SpecError where a training field it reads is still "auto"."""
    memory = spec.memory
    precision = trainer_set(spec.precision, "precision")
    clipping = _clipping(spec)
    return PlanningSettings(
        precision=precision,
        micro_batch_size=trainer_set(spec.micro_batch_size, "micro_batch_size"),
        request=knob_request(memory),
        chosen=chosen_knobs(spec),
        blocks_path=None if memory.blocks == AUTO else str(memory.blocks),
        ssd_path=None if memory.ssd.path is None else Path(memory.ssd.path).expanduser(),
        max_nvme_writes_per_day=memory.ssd.max_writes_per_day,
        checkpoint_dir=None if spec.checkpoint.dir is None else Path(spec.checkpoint.dir).expanduser(),
        checkpoints_kept=spec.checkpoint.keep_last,
        device_budget_bytes=knob(memory.device_budget),
        host_budget_bytes=knob(memory.host_budget),
        cache_dir=Path(spec.profiler.cache_dir).expanduser(),
        warmup_steps=spec.profiler.warmup_steps,
        profile_steps=spec.profiler.profile_steps,
        updates_after_norm=bool(clipping) or precision is Precision.FP16,
        keeps_gradients=keeps_gradients(
            gradient_clipping=clipping,
            loss_scaled=spec.effective_loss_scaling is not None,
            accumulation_steps=trainer_set(spec.gradient_accumulation_steps, "gradient_accumulation_steps"),
        ),
        async_save=spec.checkpoint.async_save,
        optimizer=spec.optimizer.type,
        optimizer_momentum=spec.optimizer.momentum,
    )


def chosen_knobs(spec: Spec) -> tuple[str, ...]:
    """The ``memory.*`` keys left "auto" (the planner chooses them)."""
    return tuple(path for path in auto_fields(spec) if path.startswith("memory."))


def knob_request(memory: MemorySpec) -> KnobRequest:
    """The spec's memory knobs: a number where set by hand, None where "auto"."""
    return KnobRequest(
        chunk_size=knob(memory.chunk_size),
        n_persist=knob(memory.n_persist),
        n_buffer=knob(memory.n_buffer),
        n_replicate=knob(memory.n_replicate),
        # auto without a path: no NVMe tier, nothing to choose.
        n_optimizer=knob(memory.ssd.n_optimizer) if memory.ssd.path is not None else 0,
        n_swap=knob(memory.n_swap),
        n_checkpoint=knob(memory.n_checkpoint),
        n_offload=knob(memory.ssd.n_offload),
        block_modes=memory.block_modes,
    )


def knob(value: int | Auto) -> int | None:
    """A memory knob or budget: the number set by hand, None where "auto"."""
    return None if value == AUTO else value
