"""The PlanController: the one owner of an engine's plan, from the first one to the last.

It holds the plan in force and everything that decides whether it stays: the plan check
(measured beside predicted after the first updates, ``plan_check.py``) with its peak-memory
probe (``memory_probe.py``), the verdict on cached profiles that look stale
(``profile_cache.py``), and the Replanner (``replanner.py``), which searches another plan on a
batch or when the measured peak exceeds the prediction. When a plan changes it is switched to
here: the old managers close, the training state moves into the new plan's chunk layout
(``plan_switch.py``) and the engine's state holds the new managers, which everyone who reads
them there (the checkpointer, the metrics, the trace) follows. The display only shows what it
is told (``PlanDisplay``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from torch import nn

from protrain.profiler.plan import Plan
from protrain.runtime.activations.manager import ActivationManager
from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.distributed import DistContext
from protrain.runtime.planning.memory_probe import PeakMemoryProbe
from protrain.runtime.planning.plan_check import PlanCheck, PlanCheckResult, judge
from protrain.runtime.planning.replanner import Replanner


class Waitable(Protocol):
    def wait(self) -> None: ...


class ManagedState(Protocol):
    """The engine's training state, as the controller changes it (runtime/training/state.py)."""

    @property
    def chunks(self) -> ChunkManager: ...

    @property
    def activations(self) -> ActivationManager: ...

    @property
    def checkpointer(self) -> Waitable: ...

    def replace_managers(self, chunks: ChunkManager, activations: ActivationManager) -> None: ...


class PlanDisplay(Protocol):
    """Where plans and checks are shown and recorded (the engine's reports), and what they
    measured of the last update's forward and backward phases (None: not measured here)."""

    @property
    def compute_s(self) -> float | None: ...

    def show_plan(self, plan: Plan, *, rebuilt: bool) -> None: ...

    def show_deferred_plan(self, plan: Plan) -> None: ...

    def show_check(self, result: PlanCheckResult) -> None: ...


class DeviceClaim(Protocol):
    def hold_plan(self, predicted_peak_bytes: int | None) -> None: ...


class PlanController:
    """The plan in force of one engine and its changes (see the module docstring)."""

    def __init__(
        self,
        *,
        plan: Plan,
        state: ManagedState,
        module: nn.Module,
        device: DeviceInfo,
        dist_ctx: DistContext,
        accumulation: int,
        display: PlanDisplay,
        replanner: Replanner | None = None,
        claim: DeviceClaim | None = None,
    ) -> None:
        """``replanner`` None: the plan never changes (nothing to search with)."""
        self._state = state
        self._module = module
        self._device = device
        self._dist_ctx = dist_ctx
        self._accumulation = accumulation
        self._display = display
        self._replanner = replanner
        self._claim = claim
        self.plan = plan
        self._check = PlanCheck(plan, accumulation=accumulation)
        self._probe = self._new_probe()
        self._hold(plan)

    @property
    def replans(self) -> int:
        """Plans switched to because the measured peak exceeded the prediction."""
        return 0 if self._replanner is None else self._replanner.replans

    @property
    def wants_batch(self) -> bool:
        """The plan in force waits for a batch to be profiled on (``on_batch``)."""
        return self._replanner is not None and self._replanner.wants_batch

    @property
    def measuring(self) -> bool:
        """The plan check still measures updates (their times must be read when they end)."""
        return not self._check.done

    def window_started(self) -> None:
        """An accumulation window begins: the probe watches the peak while the check wants it."""
        if self._check.measuring_peak:
            self._probe.start()

    def update_measured(self, step_time_s: float) -> None:
        """An applied update took ``step_time_s`` (its forward and backward phases: what the
        display measured). Once enough are in, the check is shown and, when the peak came out
        above the prediction, another plan is switched to. Every rank calls it (the replanner
        agrees the peak across ranks)."""
        result = self._check.observe(step_time_s, self._probe.stop, self._display.compute_s)
        if result is None:
            return
        result = self._judge(result)
        self._display.show_check(result)
        if self._replanner is not None:
            plan = self._replanner.after_window(self.plan, result, self._dist_ctx)
            if plan is not None:
                self.switch(plan)

    def _judge(self, result: PlanCheckResult) -> PlanCheckResult:
        """Compute far off the prediction of a plan made from cached profiles: they may have been
        measured at another moment. The first launch to find them off notes it in the cache
        entries; the next that finds them off again drops them, so the launch after measures
        again; one that finds them right clears the note (profile_cache.py)."""
        origin = None if self._replanner is None else self._replanner.planner.origin
        result = judge(result, from_cache=origin is not None and bool(origin.cached))
        if origin is None or result.profile != "cached":
            return result
        if not result.off:
            origin.found_right()
            return result
        dropped = origin.found_off(result.findings())
        if dropped:
            return dataclasses.replace(result, dropped_profiles=tuple(str(path) for path in dropped))
        return dataclasses.replace(result, noted_off=tuple(str(path) for path in origin.cached))

    def on_batch(self, batch: Any, *, asked: bool = True) -> None:
        """Profile on ``batch`` through the chunk engine and switch to the plan searched, once
        (``Replanner.plan_on``). ``asked`` False (the first training batch, which nobody asked to
        profile with): an output without a loss keeps the plan."""
        replanner = self._replanner
        if replanner is None:
            return
        plan = self._plan_on(batch, asked)
        if plan is None and replanner.planner.failure is not None:  # the step did not fit
            offloaded = replanner.did_not_fit(self.plan)
            if offloaded is not None:
                self.switch(offloaded)
            plan = self._plan_on(batch, asked)
            if plan is None and replanner.planner.failure is not None:
                replanner.did_not_fit(self.plan)  # raises: nothing smaller to profile under
        if plan is None:
            self._display.show_deferred_plan(self.plan)
        elif replanner.needs_switch(plan, self.plan):
            self.switch(plan)
        else:
            self._adopt(plan, rebuilt=False)  # the same knobs: keep the managers, take the predictions

    def _plan_on(self, batch: Any, asked: bool) -> Plan | None:
        assert self._replanner is not None
        state = self._state
        return self._replanner.plan_on(batch, chunks=state.chunks, activations=state.activations, asked=asked)

    def switch(self, plan: Plan) -> None:
        """Carry on under ``plan``: the chunk and activation managers are rebuilt for it and
        every parameter, moment and step count moves into its chunk layout (in memory; see
        ``plan_switch.py``). Every rank calls it, between updates."""
        if self._replanner is None:
            raise RuntimeError("this engine cannot switch plans (it was not built by runtime.initialize)")
        self._replanner.refuse_unrunnable(plan)
        state = self._state
        state.checkpointer.wait()
        # The old activation manager goes first: the new one may reuse its file directory.
        state.activations.close()
        state.replace_managers(*self._replanner.apply(plan, state_from=state.chunks))
        self._adopt(plan, rebuilt=True)

    def _adopt(self, plan: Plan, *, rebuilt: bool) -> None:
        """``plan`` is in force: its checks start over; it is shown and recorded. ``rebuilt``:
        the managers were rebuilt (the probe's hooks and static bytes go with the old plan)."""
        self.plan = plan
        self._hold(plan)
        if rebuilt:
            self._probe.stop()
            self._probe = self._new_probe()
        self._check = PlanCheck(plan, accumulation=self._accumulation)
        self._display.show_plan(plan, rebuilt=rebuilt)

    def _new_probe(self) -> PeakMemoryProbe:
        static = self._state.chunks.device_state_bytes()
        return PeakMemoryProbe(self._module, self._device, static_device_bytes=static)

    def _hold(self, plan: Plan) -> None:
        if self._claim is not None:
            self._claim.hold_plan(plan.predicted_peak_device_bytes)

    def close(self) -> None:
        """Take the probe's hooks off the model (the engine closes)."""
        if self._probe.active:
            self._probe.stop()
