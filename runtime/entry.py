"""``initialize``: a rank's composition root. Spec -> device and claim -> process group -> first
plan -> its managers -> the Engine (runtime/training/assembly.py) -> a plan on the example batch
and a resume.

Only this module, config/job.py (and the launcher) read the environment: ``PROTRAIN_SPEC`` (the
resolved spec file protrain-run wrote) and the rendezvous variables torch's launcher sets.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from protrain.runtime.blocks import refuse_foreign_activation_handling
from protrain.runtime.config.job import RunSettings, resolve_job, run_settings
from protrain.runtime.config.spec import Spec
from protrain.runtime.config.spec_io import ResolvedSpec, SpecError
from protrain.runtime.data.batches import to_device
from protrain.runtime.dry_run import dry_run
from protrain.runtime.hw import device_wall
from protrain.runtime.hw.device import DeviceInfo, select_device
from protrain.runtime.hw.distributed import DistContext, broadcast_from_main_, env_int, init_distributed, release
from protrain.runtime.model_io.weights import (
    WeightReader,
    WeightsSource,
    install_placeholders_,
    move_buffers_,
    weight_reader,
)
from protrain.runtime.observability.console import ProgressReporter, frozen_note, groups_table
from protrain.runtime.observability.run_folder import open_metrics
from protrain.runtime.observability.trackers import require_tracker_packages
from protrain.runtime.planning.apply_plan import PlanTarget, apply_plan
from protrain.runtime.planning.budgets import (
    host_parameter_bytes,
    process_rss_bytes,
    resolve_budgets,
)
from protrain.runtime.planning.first_plan import first_plan
from protrain.runtime.planning.model_facts import check_supported, compute_element_size, model_blocks
from protrain.runtime.planning.profilers import Profilers
from protrain.runtime.training import live_engines
from protrain.runtime.training.assembly import Outputs, assemble_engine
from protrain.runtime.training.engine import Engine


def initialize(
    model: nn.Module,
    *,
    config: str | os.PathLike[str] | dict[str, Any] | Spec | None = None,
    example_batch: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    weights: WeightsSource | None = None,
    profilers: Profilers | None = None,
) -> Engine:
    """Plan and build the Engine that trains ``model`` under the job spec.

    ``config``: a path, dict or Spec; None reads the file protrain-run passed in PROTRAIN_SPEC.
    ``example_batch``: a batch of the largest shape the job will use, for planning up front.
    ``loss_fn(output) -> loss`` for profiling; default ``output.loss`` or a scalar output.
    ``weights``: a state dict, a safetensors directory, or ``fn(name, tensor) -> tensor``.
    ``profilers``: the measuring functions and clocks an engine uses (tests and benchmarks
    wrap or fake them; see ``runtime.planning.planner.Profilers``).
    Under ``protrain-run --dry-run`` this prints the spec and plan and ends the process (exit 0).
    """
    host_bytes = (process_rss_bytes(), host_parameter_bytes(model))  # the process, and the model in it
    resolved, run_dir = resolve_job(config)
    settings = run_settings(resolved.spec)
    reader = weight_reader(model, weights)
    try:
        refuse_foreign_activation_handling(model, model_blocks(model, settings.planning)[1])
    except ValueError as err:
        raise SpecError(str(err)) from None
    device = select_device(env_int("LOCAL_RANK", 0))
    # The planning forwards read the batch where the model computes (a loader yields host tensors).
    example_batch = to_device(example_batch, device.device)
    if reader is not None:
        install_placeholders_(model, device.device, reader)
    else:
        # Buffers (normalisation statistics, rotary caches) are small and move now; parameters
        # stay where they are until their chunks are built (the model never moves whole).
        move_buffers_(model, device.device)
    if resolved.dry_run:
        dry_run(model, resolved, settings.planning, example_batch, loss_fn, whole=reader is None, profilers=profilers)
    # Another engine alive in this process (a teacher beside a student) owns the random streams
    # as they are: reseeding them here would change its dropout masks.
    reseed = not live_engines.others_alive()
    measuring = profilers or Profilers()
    ranks_on_host = env_int("LOCAL_WORLD_SIZE", 1)
    claim = live_engines.claim_for(
        settings.claim, device, ranks_on_host=ranks_on_host, capacity=measuring.device_capacity
    )
    dist_ctx: DistContext | None = None
    with device_wall.engine_call(claim.wall, "initialize"):
        try:
            dist_ctx = init_distributed(
                backend=device.backend,
                timeout_s=settings.dist_timeout_s,
                world_size=env_int("WORLD_SIZE", 1),
                local_rank=env_int("LOCAL_RANK", 0),
                collective_device=device.device,
            )
            engine = _build_engine(
                model, settings, resolved, run_dir, example_batch, loss_fn, reader, device, dist_ctx, claim,
                reseed=reseed, measuring=measuring, host_bytes=host_bytes,
            )  # fmt: skip
            _settle(engine, example_batch)
            return engine
        except SpecError as err:
            _release_unbuilt(claim, dist_ctx)
            note = live_engines.crowded_note(claim)
            if note and str(err).startswith("memory:"):
                raise SpecError(f"{err}{note}") from None
            raise
        except BaseException:
            _release_unbuilt(claim, dist_ctx)
            raise


def _settle(engine: Engine, example_batch: Any) -> None:
    """A plan on the example batch where the model was not profiled whole (streamed weights, or
    the profiling step did not fit: through the chunks, before a checkpoint is loaded into
    them), then the resume the spec asks for. A failure closes the engine."""
    try:
        if example_batch is not None:
            engine.plan_on_batch(example_batch)
        engine.resume()
    except BaseException as err:
        engine.__exit__(type(err), err, err.__traceback__)
        raise


def _build_engine(
    model: nn.Module,
    settings: RunSettings,
    resolved: ResolvedSpec,
    run_dir: Path | None,
    example_batch: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    reader: WeightReader | None,
    device: DeviceInfo,
    dist_ctx: DistContext,
    claim: live_engines.EngineClaim,
    *,
    reseed: bool,
    measuring: Profilers,
    host_bytes: tuple[int, int],
) -> Engine:
    """The model seeded and planned for, the first plan's managers, the Engine over them."""
    training, planning = settings.training, settings.planning
    require_tracker_packages(tensorboard=training.logging.tensorboard)  # every rank, before any collective
    host_budget = resolve_budgets(planning, device, ranks_on_host=env_int("LOCAL_WORLD_SIZE", 1))[1]
    # Rank 0's buffers everywhere; its parameters follow chunk by chunk (runtime.chunks.store).
    broadcast_from_main_(model.buffers(), dist_ctx)
    _seed(training.seed, dist_ctx, claim, reseed=reseed)
    # Profiled whole only where the model is whole on the device; else through the chunk engine
    # (on the example batch, by initialize, or on the first training batch: Engine.plan_on_batch).
    planned = first_plan(
        model,
        planning,
        example_batch=example_batch,
        whole=reader is None and measuring.holds_model(model, device.device),
        loss_fn=loss_fn,
        device=device,
        dist_ctx=dist_ctx,
        world_size=dist_ctx.world_size,
        budgets=(claim.device_budget_bytes, host_budget),
        profilers=measuring,
        host_bytes=host_bytes,
    )
    plan, params = planned.plan, planned.params
    sizes = [(p.numel, p.trainable) for p in params]
    check_supported(plan, planning, sizes)
    target = PlanTarget(params=params, training=training, planning=planning, device=device, dist_ctx=dist_ctx)
    # The run folder first: a bad output_dir is refused before chunk threads and files exist.
    metrics = open_metrics(resolved, run_dir, is_main=dist_ctx.is_main)
    try:
        managers = apply_plan(model, plan, target=target, weights=reader)
        name = None if reseed else f"engine {claim.label}"
        reporter = ProgressReporter(
            total_steps=settings.total_steps, enabled=dist_ctx.is_main, name=name, level=training.logging.level
        )
        extras = (
            groups_table(model, params, training.optimizer),
            frozen_note(params, compute_element_size(training.precision)),
        )
        # A plan to be settled on the first batch shows its table then: one table per engine.
        reporter.show_plan(plan, extras, deferred=planned.planner.wants_batch)
        if metrics is not None:
            metrics.write({"event": "plan", "plan": plan.to_dict()})
        return assemble_engine(
            model,
            settings,
            plan=plan,
            planner=planned.planner,
            target=target,
            managers=managers,
            outputs=Outputs(reporter=reporter, metrics=metrics, run_dir=run_dir),
            claim=claim,
            loss_fn=loss_fn,
            measuring=measuring,
            packed_in_use_order=example_batch is not None,  # else module order (execution_order)
        )
    except BaseException:
        if metrics is not None:
            metrics.close()
        raise


def _release_unbuilt(claim: live_engines.EngineClaim, dist_ctx: DistContext | None) -> None:
    """The engine (once built) released both itself on the way out; before that, nothing did."""
    if not claim.released:
        claim.release()
        if dist_ctx is not None:
            release(dist_ctx)


def _seed(seed: int, dist_ctx: DistContext, claim: live_engines.EngineClaim, *, reseed: bool) -> None:
    if reseed:
        # Rank-offset seed: dropout masks differ across ranks, as under DDP with per-rank seeds.
        torch.manual_seed(seed + dist_ctx.rank)
    elif dist_ctx.is_main:
        print(
            f"protrain: engine {claim.label} shares this process's random streams with the engine(s) "
            "already alive (not reseeded)",
            flush=True,
        )
