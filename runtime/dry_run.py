"""``protrain-run --dry-run``: the spec and the plan it resolves to, printed, and the process
ends (exit 0): no process group, no training step, no files.

The launcher runs the script once, in one local process, with its resolved spec (marked a dry
run) in ``PROTRAIN_SPEC``. A script may pass its own spec to ``runtime.initialize`` (a path, a
dict, a ``Spec``) or to ``ProTrainTrainer``; the dry run holds either way (``config.job.launched_dry_run``):
before, a spec passed by the script trained for real under ``--dry-run``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from torch import nn

from protrain.runtime.config.settings import PlanningSettings
from protrain.runtime.config.spec_io import ResolvedSpec, SpecError
from protrain.runtime.data.batches import to_device
from protrain.runtime.hw.device import select_device
from protrain.runtime.observability.console import plan_table
from protrain.runtime.planning.budgets import host_parameter_bytes, process_rss_bytes, resolve_budgets
from protrain.runtime.planning.first_plan import first_plan
from protrain.runtime.planning.model_facts import check_supported
from protrain.runtime.planning.profilers import Profilers


def dry_run(
    model: nn.Module,
    resolved: ResolvedSpec,
    planning: PlanningSettings,
    example_batch: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    *,
    whole: bool,
    profilers: Profilers | None,
) -> None:
    """Print the spec and the plan it resolves to, then end the process: no process group, no
    training step, no files. ``whole``: whether the model is held whole (not streamed); it is
    profiled whole where its parameters are on the device."""
    console = Console(highlight=False)
    device = select_device(0)
    example_batch = to_device(example_batch, device.device)
    planned = first_plan(
        model,
        planning,
        example_batch=example_batch,
        whole=whole and (profilers or Profilers()).holds_model(model, device.device),
        loss_fn=loss_fn,
        device=device,
        dist_ctx=None,
        world_size=resolved.world_size,
        budgets=resolve_budgets(planning, device, ranks_on_host=resolved.world_size),
        profilers=profilers,
        host_bytes=(process_rss_bytes(), host_parameter_bytes(model)),
    )
    plan, planner, params = planned.plan, planned.planner, planned.params
    console.print(
        f"[bold]Spec[/bold] from {resolved.source}"
        + (f" with {', '.join(resolved.overrides)}" if resolved.overrides else "")
    )
    console.print_json(json.dumps(resolved.spec.model_dump(mode="json")))
    console.print(f"Plan for {resolved.world_size} rank(s):")
    console.print(plan_table(plan))  # the table a real run prints
    if plan.predicted_step_s is None and planner.searchable:
        console.print(
            "Not profiled here (no example batch, or weights streamed into chunks): the run starts "
            "under this rule, profiles a batch through the chunk engine and switches to the fastest "
            "plan that fits."
        )
    try:
        sizes = [(p.numel, p.trainable) for p in params]
        check_supported(plan, planning, sizes)
    except SpecError as err:
        console.print(f"[red]This plan cannot run:[/red] {err}")
        raise SystemExit(2) from None
    console.print("dry run: no process group, no training step.")
    raise SystemExit(0)
