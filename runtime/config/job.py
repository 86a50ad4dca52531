"""The job as a rank reads it: which spec it runs under (``PROTRAIN_SPEC``, the file protrain-run
wrote, or what the script passed) and the settings the runtime takes from it beyond training
and planning (settings.py): checkpoints, and the claims an engine registers."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protrain.runtime.config.settings import (
    PlanningSettings,
    TrainingSettings,
    planning_settings_from_spec,
    settings_from_spec,
)
from protrain.runtime.config.spec import Spec
from protrain.runtime.config.spec_io import (
    RESOLVED_SPEC_ENV,
    ResolvedSpec,
    SpecError,
    load_spec,
    read_resolved,
    refuse_trainer_autos,
    validate_spec,
)
from protrain.runtime.config.spec_types import AUTO
from protrain.runtime.hw.distributed import env_int

JobConfig = str | os.PathLike[str] | dict[str, Any] | Spec | None
"""What ``initialize(config=...)`` takes: a path, a dict, a Spec, or None for ``PROTRAIN_SPEC``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointSettings:
    dir: Path | None
    interval_steps: int
    resume: str
    """"auto", "never", or a path."""
    async_save: bool
    keep_last: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimRequest:
    """What an engine claims against the others alive in its process (training/live_engines.py)."""

    device_budget: int | None
    """None: ``memory.device_budget: auto`` (what the other engines left)."""
    checkpoint_dir: Path | None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSettings:
    """Everything ``initialize`` reads of a spec, read here once."""

    training: TrainingSettings
    planning: PlanningSettings
    checkpoint: CheckpointSettings
    claim: ClaimRequest
    dist_timeout_s: float
    total_steps: int | None


def run_settings(spec: Spec) -> RunSettings:
    """``spec`` as the runtime runs it; a training field left "auto" (only the Trainer
    integration fills those) is refused, naming each."""
    refuse_trainer_autos(spec)
    return RunSettings(
        training=settings_from_spec(spec),
        planning=planning_settings_from_spec(spec),
        checkpoint=checkpoint_settings(spec),
        claim=claim_request(spec),
        dist_timeout_s=spec.launcher.dist_timeout_s,
        total_steps=spec.scheduler.total_steps,
    )


def resolve_job(
    config: JobConfig,
) -> tuple[ResolvedSpec, Path | None]:
    """The job's spec and, when protrain-run launched us, its run directory. Under
    ``protrain-run --dry-run`` a spec the script passes is a dry run too, at the launch's world
    size."""
    world_size = env_int("WORLD_SIZE", 1)
    if config is None:
        path = os.environ.get(RESOLVED_SPEC_ENV)
        if not path:
            raise SpecError(
                "no job spec: launch with protrain-run --config job.yaml, or pass "
                "runtime.initialize(model, config='job.yaml')"
            )
        resolved = read_resolved(path)
        return resolved, None if resolved.dry_run else Path(path).parent
    if isinstance(config, Spec):
        resolved = ResolvedSpec.of(config, source="(Spec object)", world_size=world_size)
    elif isinstance(config, dict):
        spec = validate_spec(config, source="config dict")
        resolved = ResolvedSpec.of(spec, source="config dict", world_size=world_size)
    else:
        resolved = ResolvedSpec.of(load_spec(config), source=str(config), world_size=world_size)
    launched = launched_dry_run()
    if launched is not None:
        resolved = dataclasses.replace(resolved, dry_run=True, world_size=launched.world_size)
    return resolved, None


def current_spec(config: JobConfig = None) -> Spec:
    """The job spec a script runs under (e.g. to seed model construction before initialize)."""
    return resolve_job(config)[0].spec


def launched_dry_run() -> ResolvedSpec | None:
    """The resolved spec ``protrain-run --dry-run`` handed this process, when it is that dry run."""
    path = os.environ.get(RESOLVED_SPEC_ENV)
    if not path:
        return None
    launched = read_resolved(path)
    return launched if launched.dry_run else None


def checkpoint_settings(spec: Spec) -> CheckpointSettings:
    section = spec.checkpoint
    return CheckpointSettings(
        dir=None if section.dir is None else Path(section.dir).expanduser(),
        interval_steps=section.interval_steps,
        resume=section.resume if section.resume in ("auto", "never") else str(Path(section.resume).expanduser()),
        async_save=section.async_save,
        keep_last=section.keep_last,
    )


def claim_request(spec: Spec) -> ClaimRequest:
    budget = spec.memory.device_budget
    folder = spec.checkpoint.dir
    return ClaimRequest(
        device_budget=None if budget == AUTO else int(budget),
        checkpoint_dir=None if folder is None else Path(folder).expanduser().resolve(),
    )
