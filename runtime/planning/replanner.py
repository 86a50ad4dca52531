"""The Replanner: what the Engine asks, on a batch and after each window, whether to carry on
under another plan, and how another plan is applied.

It owns the engine's ``Planner`` (and so the profiles the plan came from), the margin and the
limit of re-plans, and what a plan is applied to (``apply_plan``). Two occasions to change plans:

- **On a batch** (``plan_on``): the plan in force is a rule's because nothing could be profiled
  up front (no example batch, weights streamed into chunks, or the profiling step did not fit).
  The batch is profiled through the chunk engine under that plan (a model state larger than the
  device is profiled too), every block kept, gradients dropped, random streams restored: no
  training happens. Once. When the chunks were packed in module order (no example batch at
  ``initialize``), a forward without gradients through them first records the order the model
  really uses its parameters in, and the plan searched then packs by it (``_follow_first_use``).
- **After a window** (``after_window``): the plan check measured a device peak more than
  ``REPLAN_MARGIN`` above the prediction (on any rank): the profile saw less than the run needs,
  so the latest profiles are searched again with the budget shrunk by that ratio, at most
  ``MAX_REPLANS`` times, before the difference runs out of memory.

The engine's PlanController (controller.py) switches to the plan returned, through ``apply``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from protrain.profiler.plan import Plan
from protrain.runtime.activations.manager import ActivationManager
from protrain.runtime.chunks.layout import model_params
from protrain.runtime.chunks.manager import ChunkManager, SavedAlias
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.data.batches import LossNotFoundError
from protrain.runtime.hw.distributed import DistContext, all_reduce_max, broadcast_object
from protrain.runtime.planning.apply_plan import PlanTarget, apply_plan, checked_update_mode
from protrain.runtime.planning.model_profiling import ChunkedRun
from protrain.runtime.planning.plan_check import PlanCheckResult
from protrain.runtime.planning.plan_switch import hold_on_host
from protrain.runtime.planning.planner import Planner

REPLAN_MARGIN = 0.10
"""A measured peak this much above the prediction makes the engine re-plan."""
MAX_REPLANS = 2


class Replanner:
    """Decides plan changes for one engine; see the module docstring."""

    def __init__(
        self,
        *,
        planner: Planner,
        model: nn.Module,
        target: PlanTarget,
        log: Callable[[str], None],
        margin: float = REPLAN_MARGIN,
        limit: int = MAX_REPLANS,
        packed_in_use_order: bool = True,
    ) -> None:
        """``packed_in_use_order`` False: ``target.params`` are in module order (no example batch
        was run at ``initialize``); the first batch gives the order of use."""
        self.planner = planner
        self.model = model
        self.target = target
        self.log = log
        self.margin = margin
        self.limit = limit
        self.replans = 0
        """Plans switched to because the measured peak exceeded the prediction."""
        self._order_known = packed_in_use_order
        self._reordered = False
        """The next plan packs the parameters in another order than the managers in place."""

    @property
    def wants_batch(self) -> bool:
        """A batch should be profiled through the chunk engine (see ``plan_on``)."""
        return self.planner.wants_batch

    def apply(self, plan: Plan, *, state_from: ChunkManager) -> tuple[ChunkManager, ActivationManager]:
        """``plan``'s managers, the training state moved over from ``state_from`` (closed here:
        its state goes to the host and its device memory is freed before the new layout is
        built, so the device never holds both; ``refuse_unrunnable`` first)."""
        state_from.close()
        held = hold_on_host(state_from)
        self._reordered = False
        return apply_plan(self.model, plan, target=self.target, state_from=held)

    def refuse_unrunnable(self, plan: Plan) -> None:
        """``SpecError`` when the job cannot run under ``plan`` (an update mode its clipping,
        precision or accumulation rules out), before anything is torn down for it."""
        try:
            checked_update_mode(plan.update_mode, self.target.training)
        except ValueError as err:
            raise SpecError(str(err)) from None

    def needs_switch(self, plan: Plan, current: Plan) -> bool:
        """Whether ``plan`` needs new managers: other knobs, or the parameters in a new order."""
        return self._reordered or not same_layout(plan, current)

    def plan_on(self, batch: Any, *, chunks: ChunkManager, activations: ActivationManager, asked: bool) -> Plan | None:
        """The plan searched from profiling on ``batch`` through ``chunks``, once; None when
        nothing was wanted, the profiling step did not fit the device, or (``asked`` False: the
        first training batch, which nobody asked to profile with) its output has no loss."""
        if not self.planner.wants_batch:
            return None
        # Profiling steps are training steps: the module in training mode (each submodule's own
        # mode put back afterwards: a frozen part may be in eval mode on purpose), grad enabled.
        modes = [(module, module.training) for module in self.model.modules()]
        if not self.model.training:
            self.model.train()
        try:
            with torch.enable_grad(), chunks.profiling(), activations.suspended():
                if not self._order_known:
                    self._follow_first_use(batch, chunks)
                plan = self.planner.plan_on(batch, chunked_run(chunks))
        except LossNotFoundError as err:
            if asked:
                raise SpecError(str(err)) from None
            self.log(f"plan: {err}; keeping the plan")
            return None
        finally:
            for module, training in modes:
                module.training = training
        if plan is None:
            return None
        return dataclasses.replace(plan, rule=f"planned on a batch through the chunk engine: {plan.rule}")

    def _follow_first_use(self, batch: Any, chunks: ChunkManager) -> None:
        """Pack by the order of use from here on. Module order can put a parameter that backward
        reaches late in a chunk with ones it reaches early (Llama registers each layer's norms
        after its MLP): the chunk then stays incomplete while the next ones fill, and since
        reductions go in a fixed order, their gradient buffers wait too: more alive at once than
        the plan counts (docs/decisions/0014-pack-by-first-use.md)."""
        self._order_known = True
        order = self.planner.first_use_order(batch)
        chunks.end_forward()
        chunks.drain()
        # Every rank packs alike (collectives follow the layout): rank 0's order, since a forward
        # whose path depends on the data (routed experts) may touch parameters in another order.
        order = cast(list[str], broadcast_object(order, self.target.dist_ctx))
        params = model_params(self.model, order)
        if [p.name for p in params] == [p.name for p in self.target.params]:
            return
        self.target = dataclasses.replace(self.target, params=params)
        self.planner.use_params(params)
        self._reordered = True

    def did_not_fit(self, plan: Plan) -> Plan | None:
        """Profiling on a batch under ``plan`` did not fit the device: the plan with every chunk
        offloaded to profile under instead (the engine switches to it and asks ``plan_on``
        again), or, when ``plan`` offloads them already, ``SpecError``: no plan can run."""
        offloaded = self.planner.offloaded_plan(plan)
        if offloaded is not None:
            self.log("plan: profiling on a batch did not fit beside the persistent chunks; offloading every chunk")
            return offloaded
        raise SpecError(
            f"memory: no plan fits the device budget of {plan.device_budget_bytes / 2**20:.2f} MiB per rank: "
            f"a profiling step with every chunk offloaded through {plan.n_buffer} buffer(s) of "
            f"{plan.chunk_size / 2**10:.0f} KiB and the activations waiting in host memory did not fit "
            f"({self.planner.failure}); lower micro_batch_size or raise memory.device_budget"
        )

    def after_window(self, plan: Plan, check: PlanCheckResult, dist_ctx: DistContext) -> Plan | None:
        """The plan to switch to when the measured peak in ``check`` (agreed across ranks: every
        rank calls this) exceeds ``plan``'s prediction by more than the margin; None otherwise,
        past the limit, or when no plan fits the shrunk budget (said, and the plan kept)."""
        predicted = plan.predicted_peak_device_bytes
        if predicted is None or check.measured_peak_device_bytes is None:
            return None
        measured = all_reduce_max(float(check.measured_peak_device_bytes), dist_ctx)
        if measured <= predicted * (1 + self.margin) or self.replans >= self.limit:
            return None
        ratio = measured / predicted
        budget = int(plan.device_budget_bytes / ratio)
        reason = (
            f"measured peak {measured / 2**20:.1f} MiB is {ratio - 1:.0%} above the predicted "
            f"{predicted / 2**20:.1f} MiB"
        )
        try:
            found = self.planner.search_at(budget)
        except ValueError as err:  # nothing fits the shrunk budget: say so, carry on
            searched_at = f"{budget / 2**20:.1f} MiB"
            self.log(f"re-plan: {reason}, but the search at {searched_at} failed ({err}); keeping the plan")
            return None
        self.log(f"re-plan: {reason}; searching again at {budget / 2**20:.1f} MiB")
        self.replans += 1
        return dataclasses.replace(
            found,
            device_budget_bytes=plan.device_budget_bytes,
            rule=f"re-planned ({reason}; searched at {budget / 2**20:.1f} MiB): {found.rule}",
        )


def same_layout(plan: Plan, other: Plan) -> bool:
    """Whether two plans have the same knobs (then the managers in place carry out either)."""
    knobs = ("chunk_size", "n_persist", "n_buffer", "n_replicate", "block_modes", "update_mode")
    return all(getattr(plan, knob) == getattr(other, knob) for knob in knobs)


def chunked_run(chunks: ChunkManager) -> ChunkedRun:
    """The chunk engine's side of profiling steps run through it, inside ``chunks.profiling()``."""

    def pack(tensor: torch.Tensor) -> Any:
        alias = chunks.pack_alias(tensor)
        if alias is not None:
            return alias
        # A detached alias, never the tensor (runtime.activations.records.KeptTensor says why).
        return tensor if tensor.grad_fn is None else tensor.detach()

    def unpack(packed: Any) -> torch.Tensor:
        return chunks.unpack_alias(packed) if isinstance(packed, SavedAlias) else packed

    return ChunkedRun(
        pack=pack,
        unpack=unpack,
        model_state=chunks.model_state_storages,
        stall_s=lambda: chunks.stall_s,
        end_forward=chunks.end_forward,
        end_step=chunks.drain,
    )
