"""The first plan of a run: the model's parameters in the order it uses them, the Planner over
them and the plan the run starts under. ``initialize`` and the dry run share it. On several
ranks every input is agreed first (rank 0's order, the smallest budgets, the largest process),
so every rank plans alike: collectives follow the plan, and a rank that planned otherwise would
wait forever in one the others never issue."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from protrain.profiler.plan import BlockMode, Plan
from protrain.runtime.chunks.layout import ParamInfo, model_params
from protrain.runtime.config.settings import PlanningSettings
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.distributed import DistContext, all_reduce_max, all_reduce_min_, broadcast_object
from protrain.runtime.planning.model_facts import execution_order
from protrain.runtime.planning.planner import Planner, build_planner
from protrain.runtime.planning.profilers import Profilers


@dataclass(frozen=True, slots=True)
class FirstPlan:
    params: tuple[ParamInfo, ...]
    """The model's parameters in first-use order (module order without an example batch)."""
    planner: Planner
    plan: Plan


def first_plan(
    model: nn.Module,
    planning: PlanningSettings,
    *,
    example_batch: Any,
    whole: bool,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    device: DeviceInfo,
    dist_ctx: DistContext | None,
    world_size: int,
    budgets: tuple[int, int],
    profilers: Profilers | None,
    host_bytes: tuple[int, int],
) -> FirstPlan:
    """``whole``: the model is whole on the device, so it is profiled whole on ``example_batch``
    (else the plan is a rule's, until a batch is profiled through the chunk engine).
    ``budgets``: (device, host) bytes; ``host_bytes``: (the process, the model's parameters)."""
    order = execution_order(model, example_batch, device)
    if dist_ctx is not None:
        # Rank 0's order everywhere: the layout must match, and routed experts may differ by data.
        order = cast(list[str] | None, broadcast_object(order, dist_ctx))
        budgets = _agreed_budgets(budgets, dist_ctx)
        host_bytes = (
            int(all_reduce_max(float(host_bytes[0]), dist_ctx)),
            int(all_reduce_max(float(host_bytes[1]), dist_ctx)),
        )
    params = model_params(model, order)
    planner = build_planner(
        model,
        planning,
        params=params,
        world_size=world_size,
        budgets=budgets,
        loss_fn=loss_fn,
        device=device,
        dist_ctx=dist_ctx,
        profilers=profilers,
        host_baseline_bytes=host_bytes[0],
        host_model_bytes=host_bytes[1],
    )
    plan = planner.initial_plan(example_batch if whole else None)
    if dist_ctx is not None:
        _check_same_plan_everywhere(plan, dist_ctx)
    return FirstPlan(params=params, planner=planner, plan=plan)


def _largest(value: int, dist_ctx: DistContext) -> int:
    return int(all_reduce_max(float(value), dist_ctx))


def _agreed_budgets(budgets: tuple[int, int], dist_ctx: DistContext) -> tuple[int, int]:
    agreed = all_reduce_min_(torch.tensor(budgets, dtype=torch.float64), dist_ctx)
    return int(agreed[0].item()), int(agreed[1].item())


def _check_same_plan_everywhere(plan: Plan, dist_ctx: DistContext) -> None:
    """A rank that planned differently (another spec, model or example batch) is refused."""
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
