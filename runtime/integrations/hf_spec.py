"""``TrainingArguments`` and the ProTrain spec: one value per setting (accelerate#936: two
config files that disagree in silence).

The training values both can hold (the optimizer, its learning rate, betas and epsilon, weight
decay, SGD's momentum values in ``optim_args``, per-device batch, accumulation, precision,
clipping, seed; and for checkpoints the output directory, the save interval and how many are
kept) are reconciled per setting:

- set in the spec (a key the user wrote: pydantic's ``model_fields_set``; ``"auto"`` counts as
  unset) and in TrainingArguments (a value other than the field's default), to different values:
  refused, naming both (``SpecError``, a ``ValueError``: exit 2 through protrain-run);
- set in the spec only: the Trainer takes the spec's value (on its own copy of the arguments);
- otherwise the spec takes the TrainingArguments value, defaults included, so that a
  ``ProTrainTrainer`` trains what a plain ``Trainer`` with the same arguments trains.

The learning-rate schedule is the Trainer's own (its scheduler writes the engine optimizer's
learning rates) unless the spec sets ``scheduler``: then the spec's schedule runs as the Trainer's
scheduler, and TrainingArguments that set one too are refused. Checkpoints are the Trainer's
(``checkpoint-N`` folders holding the engine's checkpoint): the engine itself never saves or
resumes on its own, so ``checkpoint.resume`` and ``checkpoint.async_save`` are refused.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from protrain.runtime.config.spec import AUTO, Spec
from protrain.runtime.config.spec_io import RESOLVED_SPEC_ENV, SpecError, load_spec, validate_spec
from protrain.runtime.integrations.hf_optim import OPTIM_OF_TYPE, TRAINER_OPTIMS, optim_name, sgd_values

SpecSource = str | os.PathLike[str] | dict[str, Any] | Spec | None
"""A spec file's path, a mapping of spec keys, a ``Spec``; None: protrain-run's spec when it
launched this process, else the defaults (every memory knob planned)."""

_FIELD_DEFAULT_AFTER_INIT = {"output_dir": "trainer_output"}
"""TrainingArguments fields whose default becomes another value in ``__post_init__``."""


def user_spec(source: SpecSource) -> Spec:
    """The spec ``protrain=`` names, keeping which keys the user set."""
    if isinstance(source, Spec):
        return source
    if isinstance(source, dict):
        return validate_spec(source, source="protrain= dict")
    if source is not None:
        return load_spec(source)
    if os.environ.get(RESOLVED_SPEC_ENV):
        from protrain.runtime.config.job import current_spec

        return current_spec(None)
    return Spec()


def set_paths(model: BaseModel, prefix: str = "") -> set[str]:
    """Dotted paths of the keys a spec (section) set, at every depth; "auto" counts as unset."""
    found: set[str] = set()
    for name in model.model_fields_set:
        value = getattr(model, name)
        if value == AUTO:
            continue
        found.add(prefix + name)
        if isinstance(value, BaseModel):
            found |= set_paths(value, f"{prefix}{name}.")
    return found


@dataclass(frozen=True, slots=True)
class Pair:
    """A spec key and the TrainingArguments fields that hold the same setting."""

    key: str
    fields: tuple[str, ...]
    read: Callable[[Any], Any]
    """TrainingArguments -> the value in the spec's terms (None: not expressible there)."""
    write: Callable[[Any], dict[str, Any]]
    """A spec value -> the TrainingArguments fields that say it."""
    engine: bool = True
    """The engine trains by it (else only the Trainer does: a checkpoint setting)."""


def _one(key: str, field: str, cast: Callable[[Any], Any] = lambda value: value) -> Pair:
    return Pair(key, (field,), lambda args: cast(getattr(args, field)), lambda value: {field: value})


def _precision(args: Any) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def _precision_args(value: str) -> dict[str, bool]:
    return {"bf16": value == "bf16", "fp16": value == "fp16"}


def _save_interval(args: Any) -> int | None:
    if args.save_strategy == "no":
        return 0
    steps = args.save_steps
    return int(steps) if args.save_strategy == "steps" and steps >= 1 and steps == int(steps) else None


def _save_steps(steps: int) -> dict[str, Any]:
    return {"save_strategy": "no"} if steps == 0 else {"save_strategy": "steps", "save_steps": steps}


PAIRS: tuple[Pair, ...] = (
    Pair(
        "optimizer.type",
        ("optim",),
        lambda args: TRAINER_OPTIMS.get(optim_name(args), optim_name(args)),
        lambda rule: {"optim": OPTIM_OF_TYPE[rule]} if rule in OPTIM_OF_TYPE else {},
    ),
    _one("optimizer.lr", "learning_rate", float),
    Pair(
        "optimizer.betas",
        ("adam_beta1", "adam_beta2"),
        lambda args: (float(args.adam_beta1), float(args.adam_beta2)),
        lambda betas: {"adam_beta1": betas[0], "adam_beta2": betas[1]},
    ),
    _one("optimizer.eps", "adam_epsilon", float),
    _one("optimizer.weight_decay", "weight_decay", float),
    _one("micro_batch_size", "per_device_train_batch_size"),
    _one("gradient_accumulation_steps", "gradient_accumulation_steps"),
    Pair("precision", ("bf16", "fp16"), _precision, _precision_args),
    _one("gradient_clipping", "max_grad_norm", float),
    _one("seed", "seed"),
    Pair("checkpoint.dir", ("output_dir",), lambda args: args.output_dir, lambda d: {"output_dir": d}, False),
    Pair("checkpoint.interval_steps", ("save_strategy", "save_steps"), _save_interval, _save_steps, False),
    Pair(
        "checkpoint.keep_last",
        ("save_total_limit",),
        lambda args: args.save_total_limit,
        lambda keep: {"save_total_limit": keep},
        False,
    ),
)

TRAINER_LOSS_SCALING = {"initial": 65536.0, "growth_interval": 2000}
"""fp16 under a Trainer: its GradScaler's start and growth interval (torch's defaults), unless
the spec sets loss_scaling."""
SCHEDULE_FIELDS = ("lr_scheduler_type", "warmup_steps", "lr_scheduler_kwargs")
NOT_UNDER_TRAINER = {
    "checkpoint.resume": "resume with trainer.train(resume_from_checkpoint=True or a checkpoint-N folder)",
    "checkpoint.async_save": "the Trainer writes its checkpoints itself, in the foreground",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Reconciled:
    spec: Spec
    """The spec the engine runs: the user's, its unset training values filled."""
    args_updates: dict[str, Any]
    """TrainingArguments fields the Trainer takes from the spec."""
    spec_schedule: bool
    """The spec sets the learning-rate schedule (else the Trainer's own scheduler runs)."""


def reconcile(spec: Spec, args: Any) -> Reconciled:
    """Check ``spec`` against ``args`` (a ``TrainingArguments``) and settle each shared value."""
    written = set_paths(spec)
    for key, instead in NOT_UNDER_TRAINER.items():
        if key in written:
            raise SpecError(f"{key} in the ProTrain spec does not apply under a Trainer: {instead}")
    data = spec.model_dump(mode="json", exclude_unset=True)
    updates: dict[str, Any] = {}
    for pair in PAIRS:
        ours, theirs = _normalised(pair.key, _get(spec, pair.key)), pair.read(args)
        if pair.key in written and _args_set(args, pair.fields):
            if ours != theirs:
                raise SpecError(_conflict(pair.key, ours, args, pair.fields))
        elif pair.key in written:
            adopted = pair.write(ours)
            updates.update({name: value for name, value in adopted.items() if getattr(args, name) != value})
        elif pair.engine:
            _put(data, pair.key, list(theirs) if isinstance(theirs, tuple) else theirs)
    _sgd_optim_args(spec, args, data, written)
    updates.update(_eval_batch(args, micro_batch=int(data.get("micro_batch_size", spec.micro_batch_size))))
    if data.get("precision") == "fp16" and "loss_scaling" not in written:
        data["loss_scaling"] = TRAINER_LOSS_SCALING
    spec_schedule = any(path.startswith("scheduler.") for path in written)
    if spec_schedule and _args_set(args, SCHEDULE_FIELDS):
        named = [name for name in SCHEDULE_FIELDS if _args_set(args, (name,))]
        set_fields = ", ".join(f"{name}={getattr(args, name)!r}" for name in named)
        raise SpecError(
            f"the ProTrain spec sets scheduler and TrainingArguments set {set_fields}: set the learning-rate "
            "schedule in one place"
        )
    # The Trainer saves and resumes; the engine's own run folder goes beside its checkpoints.
    data["checkpoint"] = {"dir": None, "interval_steps": 0, "resume": "never"}
    if "output_dir" not in written:
        data["output_dir"] = str(Path(updates.get("output_dir", args.output_dir)) / "protrain")
    return Reconciled(
        spec=validate_spec(data, source="the ProTrain spec with the TrainingArguments values"),
        args_updates=updates,
        spec_schedule=spec_schedule,
    )


def _sgd_optim_args(spec: Spec, args: Any, data: dict[str, Any], written: set[str]) -> None:
    """optim="sgd" with ``optim_args`` ("momentum=0.9,nesterov=True"): each value it sets is the
    spec's, unless the spec sets it otherwise (refused, naming both)."""
    if data.get("optimizer", {}).get("type", spec.optimizer.type) != "sgd":
        return
    for name, value in sgd_values(args.optim_args).items():
        key = f"optimizer.{name}"
        if key in written and _get(spec, key) != value:
            raise SpecError(
                f"{key}={_get(spec, key)!r} in the ProTrain spec and optim_args={args.optim_args!r} in "
                "TrainingArguments disagree: set it in one place (the other takes it)"
            )
        _put(data, key, value)


def _eval_batch(args: Any, *, micro_batch: int) -> dict[str, Any]:
    """The engine's plan holds for batches no larger than the training one: evaluation batches
    left at their default take its size; larger ones set by hand are refused."""
    if args.per_device_eval_batch_size <= micro_batch:
        return {}
    if _args_set(args, ("per_device_eval_batch_size",)):
        raise SpecError(
            f"per_device_eval_batch_size={args.per_device_eval_batch_size} is larger than the training "
            f"batch ({micro_batch}) the engine's memory plan is made for; make it at most that"
        )
    return {"per_device_eval_batch_size": micro_batch}


def with_args(args: Any, updates: dict[str, Any]) -> Any:
    """A copy of ``args`` with ``updates`` (the caller's object is left as it was)."""
    if not updates:
        return args
    adopted = copy.copy(args)
    for name, value in updates.items():
        setattr(adopted, name, value)
    return adopted


def with_decay_groups(spec: Spec, no_decay_names: Iterable[str]) -> Spec:
    """The Trainer's weight-decay rule as spec groups: the top level decays, one group of the
    Trainer's no-decay parameters (named exactly) does not. A spec that sets ``optimizer.groups``
    or ``optimizer.no_decay`` keeps its own rule."""
    written = set_paths(spec)
    if "optimizer.groups" in written or "optimizer.no_decay" in written:
        return spec
    data = spec.model_dump(mode="json", exclude_unset=True)
    names = sorted(no_decay_names)
    optimizer = data.setdefault("optimizer", {})
    optimizer["no_decay"] = []
    exempt = [{"match": [_literal(name) for name in names], "weight_decay": 0.0}]
    optimizer["groups"] = exempt if names else []
    return validate_spec(data, source="the ProTrain spec with the Trainer's weight-decay groups")


def _literal(name: str) -> str:
    """A shell-style pattern matching exactly ``name``."""
    return "".join(f"[{char}]" if char in "*?[" else char for char in name)


def _get(spec: Spec, key: str) -> Any:
    value: Any = spec
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _put(data: dict[str, Any], key: str, value: Any) -> None:
    *sections, leaf = key.split(".")
    for section in sections:
        data = data.setdefault(section, {})
    data[leaf] = value


def _normalised(key: str, value: Any) -> Any:
    if isinstance(value, str) and value == AUTO:
        return value  # unset: the TrainingArguments value fills it
    if key == "gradient_clipping":
        return float(value or 0.0)  # null and 0 both mean off, as max_grad_norm=0 does
    if key == "precision":
        return value.value
    if key == "checkpoint.dir" and value is not None:
        return str(value)
    return value


def _args_set(args: Any, names: Iterable[str]) -> bool:
    """Whether one of ``names`` holds other than its default in ``args``' class."""
    defaults = {field.name: field for field in dataclasses.fields(args)}
    for name in names:
        field = defaults[name]
        default = field.default if field.default is not dataclasses.MISSING else None
        if field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        value = getattr(args, name)
        if value != default and value != _FIELD_DEFAULT_AFTER_INIT.get(name, default):
            return True
    return False


def _conflict(key: str, ours: Any, args: Any, fields: tuple[str, ...]) -> str:
    theirs = ", ".join(f"{name}={getattr(args, name)!r}" for name in fields)
    return (
        f"{key}={ours!r} in the ProTrain spec and {theirs} in TrainingArguments disagree: set it in one "
        "place (the other takes it)"
    )
