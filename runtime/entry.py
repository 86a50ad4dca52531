"""``initialize``: a rank's composition root. Spec -> process group -> plan -> Engine.

Only this module (and the launcher) reads the environment: ``PROTRAIN_SPEC`` (the resolved spec
file protrain-run wrote) and the rendezvous variables torch's launcher sets.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from protrain.profiler.plan import BlockMode, Plan
from protrain.runtime.batches import to_device
from protrain.runtime.blocks import refuse_foreign_activation_handling
from protrain.runtime.checkpoint.checkpointer import Checkpointer, CheckpointSettings
from protrain.runtime.chunks.layout import model_params
from protrain.runtime.config.settings import planning_settings_from_spec, settings_from_spec
from protrain.runtime.config.spec import AUTO, Spec
from protrain.runtime.config.spec_io import (
    RESOLVED_SPEC_ENV,
    ResolvedSpec,
    SpecError,
    load_spec,
    read_resolved,
    refuse_trainer_autos,
    validate_spec,
)
from protrain.runtime.console import MetricsFile, ProgressReporter, frozen_note, groups_table
from protrain.runtime.dry_run import dry_run, launched_dry_run
from protrain.runtime.hw import device_wall
from protrain.runtime.hw.device import DeviceInfo, select_device
from protrain.runtime.hw.distributed import (
    DistContext,
    all_reduce_max,
    all_reduce_min_,
    broadcast_from_main_,
    broadcast_object,
    env_int,
    init_distributed,
    release,
)
from protrain.runtime.metrics.trackers import require_tracker_packages
from protrain.runtime.planning.apply_plan import PlanTarget, apply_plan
from protrain.runtime.planning.budgets import (
    auto_device_budget,
    host_parameter_bytes,
    process_rss_bytes,
    resolve_budgets,
)
from protrain.runtime.planning.model_facts import check_supported, compute_element_size, execution_order, model_blocks
from protrain.runtime.planning.planner import Profilers, build_planner
from protrain.runtime.planning.replanner import Replanner
from protrain.runtime.tracing.trace_window import trace_window_for
from protrain.runtime.training import live_engines
from protrain.runtime.training.engine import Engine
from protrain.runtime.training.stop import StopRequest
from protrain.runtime.weights import (
    WeightReader,
    WeightsSource,
    held_on,
    install_placeholders_,
    load_weights_,
    move_buffers_,
)


def resolve_job(
    config: str | os.PathLike[str] | dict[str, Any] | Spec | None,
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


def current_spec(config: str | os.PathLike[str] | dict[str, Any] | Spec | None = None) -> Spec:
    """The job spec a script runs under (e.g. to seed model construction before initialize)."""
    return resolve_job(config)[0].spec


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
    ``profilers``: the measuring functions planning calls (tests and benchmarks wrap them to
    count or time the measurements; see ``runtime.planning.planner.Profilers``).
    Under ``protrain-run --dry-run`` this prints the spec and plan and ends the process (exit 0).
    """
    host_baseline = process_rss_bytes()  # the interpreter, torch, the caller's model: the plan counts it
    host_model = host_parameter_bytes(model)  # of which the chunks take over
    resolved, run_dir = resolve_job(config)
    spec = resolved.spec
    refuse_trainer_autos(spec)
    planning = planning_settings_from_spec(spec)
    reader = _weight_reader(model, weights)
    try:
        refuse_foreign_activation_handling(model, model_blocks(model, planning)[1])
    except ValueError as err:
        raise SpecError(str(err)) from None
    device = select_device(env_int("LOCAL_RANK", 0))
    if reader is not None:
        install_placeholders_(model, device.device, reader)
    else:
        # Buffers (normalisation statistics, rotary caches) are small and move now; parameters
        # stay where they are until their chunks are built (the model never moves whole).
        move_buffers_(model, device.device)
    if resolved.dry_run:
        dry_run(model, resolved, planning, example_batch, loss_fn, whole=reader is None, profilers=profilers)
    # Another engine alive in this process (a teacher beside a student) owns the random streams
    # as they are: reseeding them here would change its dropout masks.
    reseed = not live_engines.others_alive()
    claim = _claim(spec, device, ranks_on_host=env_int("LOCAL_WORLD_SIZE", 1))
    dist_ctx: DistContext | None = None
    with device_wall.engine_call(claim.wall, "initialize"):
        try:
            dist_ctx = init_distributed(
                backend=device.backend,
                timeout_s=spec.launcher.dist_timeout_s,
                world_size=env_int("WORLD_SIZE", 1),
                local_rank=env_int("LOCAL_RANK", 0),
                collective_device=device.device,
            )
            return _build_engine(
                model,
                resolved,
                run_dir,
                example_batch=example_batch,
                loss_fn=loss_fn,
                reader=reader,
                device=device,
                dist_ctx=dist_ctx,
                claim=claim,
                reseed=reseed,
                profilers=profilers,
                host_baseline=(host_baseline, host_model),
            )
        except SpecError as err:
            _release_unbuilt(claim, dist_ctx)
            note = live_engines.crowded_note(claim)
            if note and str(err).startswith("memory:"):
                raise SpecError(f"{err}{note}") from None
            raise
        except BaseException:
            _release_unbuilt(claim, dist_ctx)
            raise


def _release_unbuilt(claim: live_engines.EngineClaim, dist_ctx: DistContext | None) -> None:
    """The engine (once built) released both itself on the way out; before that, nothing did."""
    if not claim.released:
        claim.release()
        if dist_ctx is not None:
            release(dist_ctx)


def _call_site() -> str:
    """Where the caller made the engine: the innermost frame outside ProTrain and the libraries
    that call it for the caller (a Trainer's seams), as file:line."""
    ours = str(Path(__file__).resolve().parent)
    frames = traceback.extract_stack()[:-2]
    for frame in reversed(frames):
        path = frame.filename
        if not path.startswith(ours) and "site-packages" not in path and not path.startswith("<"):
            return f"{path}:{frame.lineno}"
    return f"{frames[0].filename}:{frames[0].lineno}" if frames else "(unknown)"


def _weight_reader(model: nn.Module, weights: WeightsSource | None) -> WeightReader | None:
    """The reader of a model built on the meta device: it is never materialised whole, its
    parameters get stand-ins and each is read from the weights straight into its chunk. Weights
    for a materialised model are loaded into it now."""
    streamed = weights is not None and any(p.is_meta for p in model.parameters())
    reader = WeightReader(weights, model) if streamed and weights is not None else None
    if weights is not None and reader is None:
        load_weights_(model, weights)
    if reader is None:
        _refuse_meta(model)
    return reader


def _claim(spec: Spec, device: DeviceInfo, *, ranks_on_host: int) -> live_engines.EngineClaim:
    """This engine's device budget and checkpoint directory, registered against the other engines
    alive in this process (an auto budget is what they left)."""
    auto = spec.memory.device_budget == AUTO
    return live_engines.claim(
        device_budget=None if auto else int(spec.memory.device_budget),
        measured_auto_bytes=auto_device_budget(device, ranks_on_host) if auto else 0,
        checkpoint_dir=None if spec.checkpoint.dir is None else Path(spec.checkpoint.dir).expanduser().resolve(),
        device=device.device,
        created_at=_call_site(),
    )


def _build_engine(
    model: nn.Module,
    resolved: ResolvedSpec,
    run_dir: Path | None,
    *,
    example_batch: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    reader: WeightReader | None,
    device: DeviceInfo,
    dist_ctx: DistContext,
    claim: live_engines.EngineClaim,
    reseed: bool,
    profilers: Profilers | None,
    host_baseline: tuple[int, int] = (0, 0),
) -> Engine:
    """The composition root: the model placed and seeded, its planner, the first plan applied,
    the outputs, and the Engine over them (which then plans on the example batch, if the model
    could not be profiled whole, and resumes from a checkpoint)."""
    spec = resolved.spec
    training, planning = settings_from_spec(spec), planning_settings_from_spec(spec)
    require_tracker_packages(tensorboard=training.logging.tensorboard)  # every rank, before any collective
    ranks_on_host = env_int("LOCAL_WORLD_SIZE", 1)
    budgets = (claim.device_budget_bytes, resolve_budgets(planning, device, ranks_on_host=ranks_on_host)[1])
    # Rank 0's buffers everywhere; its parameters follow chunk by chunk (runtime.chunks.store).
    broadcast_from_main_(model.buffers(), dist_ctx)
    _seed(spec.seed, dist_ctx, claim, reseed=reseed)
    example_batch = to_device(example_batch, device.device)
    # Run whole (first-use order, a profile) only where the parameters already are on the device:
    # a model in host memory on a GPU is profiled through its chunks (Engine.plan_on_batch).
    whole = reader is None and held_on(model, device.device)
    # Rank 0's order everywhere: the layout must match, and routed experts may differ by data.
    order = cast(list[str] | None, broadcast_object(execution_order(model, example_batch, device), dist_ctx))
    params = model_params(model, order)
    planner = build_planner(
        model,
        planning,
        params=params,
        world_size=dist_ctx.world_size,
        budgets=_agreed_budgets(budgets, dist_ctx),
        loss_fn=loss_fn,
        device=device,
        dist_ctx=dist_ctx,
        profilers=profilers,
        # Every rank plans alike: the largest process and model of any rank.
        host_baseline_bytes=int(all_reduce_max(float(host_baseline[0]), dist_ctx)),
        host_model_bytes=int(all_reduce_max(float(host_baseline[1]), dist_ctx)),
    )
    # Profiling the model whole needs it whole on the device: one whose weights are streamed
    # into chunks, or held in host memory, is profiled through the chunk engine instead
    # (Engine.plan_on_batch, below).
    plan = planner.initial_plan(example_batch if whole else None)
    _check_same_plan_everywhere(plan, dist_ctx)
    check_supported(
        plan, planning.precision, [(p.numel, p.trainable) for p in params], keeps_gradients=planning.keeps_gradients
    )
    target = PlanTarget(params=params, training=training, planning=planning, device=device, dist_ctx=dist_ctx)
    # The run folder first: a bad output_dir is refused before chunk threads and files exist.
    metrics = _open_metrics(resolved, run_dir, dist_ctx)
    try:
        chunks, activations = apply_plan(model, plan, target=target, weights=reader)
    except BaseException:
        if metrics is not None:
            metrics.close()
        raise
    reporter = ProgressReporter(
        total_steps=spec.scheduler.total_steps,
        enabled=dist_ctx.is_main,
        name=None if reseed else f"engine {claim.label}",
        level=training.logging.level,
    )
    extras = (
        groups_table(model, params, training.optimizer),
        frozen_note(params, compute_element_size(training.precision)),
    )
    # A plan to be settled on the first batch shows its table then: one table per engine.
    reporter.show_plan(plan, extras, deferred=planner.wants_batch)
    if metrics is not None:
        metrics.write({"event": "plan", "plan": plan.to_dict()})
    engine = Engine(
        module=model,
        plan=plan,
        settings=training,
        dist_ctx=dist_ctx,
        device=device,
        reporter=reporter,
        metrics=metrics,
        chunks=chunks,
        activations=activations,
        checkpointer=Checkpointer(
            chunks=chunks,
            module=model,
            dist_ctx=dist_ctx,
            settings=_checkpoint_settings(spec),
            seed=spec.seed,
        ),
        stop=StopRequest(announce=dist_ctx.is_main).install(),
        claim=claim,
        loss_fn=loss_fn,
        replanner=Replanner(
            planner=planner,
            model=model,
            target=target,
            log=reporter.print,
            packed_in_use_order=example_batch is not None,  # else module order (execution_order)
        ),
        trace=trace_window_for(training.logging.trace, run_dir, metrics, dist_ctx, device, reporter.print),
    )
    try:
        if example_batch is not None:
            # Not profiled whole (streamed weights, or the profiling step did not fit): profile
            # through the chunks now, before a checkpoint is loaded into them.
            engine.plan_on_batch(example_batch)
        engine.resume()
    except BaseException as err:
        engine.__exit__(type(err), err, err.__traceback__)
        raise
    return engine


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


def _agreed_budgets(budgets: tuple[int, int], dist_ctx: DistContext) -> tuple[int, int]:
    """Every rank must run the same plan (collective order depends on it): agree on the smallest."""
    agreed = all_reduce_min_(torch.tensor(budgets, dtype=torch.float64), dist_ctx)
    return int(agreed[0].item()), int(agreed[1].item())


def _checkpoint_settings(spec: Spec) -> CheckpointSettings:
    section = spec.checkpoint
    return CheckpointSettings(
        dir=None if section.dir is None else Path(section.dir).expanduser(),
        interval_steps=section.interval_steps,
        resume=section.resume if section.resume in ("auto", "never") else str(Path(section.resume).expanduser()),
        async_save=section.async_save,
        keep_last=section.keep_last,
    )


def _check_same_plan_everywhere(plan: Plan, dist_ctx: DistContext) -> None:
    """Every rank must run the same plan (collective order depends on it): a rank that planned
    differently would otherwise wait forever in a collective the others never issue."""
    if dist_ctx.world_size == 1:
        return
    knobs = [plan.chunk_size, plan.num_chunks, plan.n_persist, plan.n_buffer]
    knobs += [list(BlockMode).index(mode) for mode in plan.block_modes]
    low = all_reduce_min_(torch.tensor(knobs, dtype=torch.float64), dist_ctx)
    high = -all_reduce_min_(-torch.tensor(knobs, dtype=torch.float64), dist_ctx)
    if not torch.equal(low, high):
        raise RuntimeError(
            f"rank {dist_ctx.rank} planned chunk_size={plan.chunk_size}, n_persist={plan.n_persist}, "
            f"n_buffer={plan.n_buffer}, but the ranks disagree; every rank must see the same spec, "
            "model and example batch"
        )


def _refuse_meta(model: nn.Module) -> None:
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(
            f"{len(meta)} parameters (e.g. {meta[0]}) are on the meta device and no weights were "
            "given; pass initialize(..., weights=...) with a state dict, a safetensors directory "
            "or a callable"
        )


def _open_metrics(resolved: ResolvedSpec, run_dir: Path | None, dist_ctx: DistContext) -> MetricsFile | None:
    if not dist_ctx.is_main:
        return None
    if run_dir is None:
        # Not launched by protrain-run: rank 0 makes its own run folder (no other rank writes).
        output_dir = Path(resolved.spec.output_dir).expanduser()
        try:
            run_dir = _new_run_dir(output_dir)
        except OSError as err:
            raise SpecError(
                f"output_dir: {output_dir} cannot hold run folders ({err.strerror or err}); give a "
                "directory this user can write (made when missing)"
            ) from None
        (run_dir / "spec.json").write_text(resolved.to_json(), encoding="utf-8")
    return MetricsFile(run_dir / "metrics.jsonl")


def _new_run_dir(output_dir: Path) -> Path:
    """A fresh ``{time}-{pid}`` folder: a second engine in the same process and second gets
    its own (``-2``, ...), not a share of the first one's metrics."""
    output_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    for attempt in itertools.count(1):
        run_dir = output_dir / (stem if attempt == 1 else f"{stem}-{attempt}")
        try:
            run_dir.mkdir()
        except FileExistsError:
            continue
        return run_dir
    raise AssertionError("unreachable")
