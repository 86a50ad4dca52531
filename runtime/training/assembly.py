"""The Engine put together over a plan's managers: its training state, its reports and trace,
the plan's owner, the clocks it is timed by. ``initialize`` (runtime/entry.py) calls it once the
first plan is applied; if any part fails to come up, the state closes what was already made."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from protrain.profiler.plan import Plan
from protrain.runtime.activations.manager import ActivationManager
from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.config.job import RunSettings
from protrain.runtime.data.loaders import DataPosition
from protrain.runtime.observability.console import MetricsFile, ProgressReporter
from protrain.runtime.observability.reporting import UpdateReports
from protrain.runtime.observability.trace_window import trace_window_for
from protrain.runtime.planning.apply_plan import PlanTarget
from protrain.runtime.planning.controller import PlanController
from protrain.runtime.planning.planner import Planner
from protrain.runtime.planning.profilers import Profilers
from protrain.runtime.planning.replanner import Replanner
from protrain.runtime.training.engine import Engine
from protrain.runtime.training.live_engines import EngineClaim
from protrain.runtime.training.loss_scale import DynamicLossScaler
from protrain.runtime.training.state import TrainingState
from protrain.runtime.training.stop import StopRequest


@dataclass(frozen=True, slots=True, kw_only=True)
class Outputs:
    """Where an engine reports: the console, and on rank 0 the run folder's metrics file."""

    reporter: ProgressReporter
    metrics: MetricsFile | None
    run_dir: Path | None


def assemble_engine(
    model: nn.Module,
    settings: RunSettings,
    *,
    plan: Plan,
    planner: Planner,
    target: PlanTarget,
    managers: tuple[ChunkManager, ActivationManager],
    outputs: Outputs,
    claim: EngineClaim,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    measuring: Profilers,
    packed_in_use_order: bool,
) -> Engine:
    """``packed_in_use_order`` False: the chunks pack the parameters in module order (no example
    batch); the first batch gives the order of use (``Replanner``)."""
    training, device, dist_ctx = settings.training, target.device, target.dist_ctx
    chunks, activations = managers
    state = TrainingState(
        chunks=chunks,
        activations=activations,
        dist_ctx=dist_ctx,
        module=model,
        checkpoint=settings.checkpoint,
        seed=training.seed,
        data_position=DataPosition(dist_ctx, micro_batch_size=training.micro_batch_size, seed=training.seed),
        loss_scaler=DynamicLossScaler(training.loss_scale) if training.loss_scale else None,
        stop=StopRequest(announce=dist_ctx.is_main).install(),
        claim=claim,
    )
    try:
        reporter = outputs.reporter
        reports = UpdateReports(
            module=model,
            device=device,
            reporter=reporter,
            metrics=outputs.metrics,
            settings=training,
            sources=state,
            compute_clock=measuring.compute_clock,
        )
        state.observers.append(reports)
        trace = trace_window_for(
            training.logging.trace, outputs.run_dir, outputs.metrics, dist_ctx, device, reporter.print
        )
        state.observers.append(trace)
        replanner = Replanner(
            planner=planner, model=model, target=target, log=reporter.print, packed_in_use_order=packed_in_use_order
        )
        plans = PlanController(
            plan=plan,
            state=state,
            module=model,
            device=device,
            dist_ctx=dist_ctx,
            accumulation=training.gradient_accumulation_steps,
            display=reports,
            replanner=replanner,
            claim=claim,
        )
        state.observers.append(plans)
        return Engine(
            state=state,
            settings=training,
            device=device,
            reporter=reporter,
            observers=(reports, trace),
            plans=plans,
            loss_fn=loss_fn,
            clock=measuring.clock,
            wait_for_device=measuring.synchronize,
        )
    except BaseException:
        state.close()
        raise
