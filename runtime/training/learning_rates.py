"""The learning rate of each optimizer group for the next update: the spec's schedule, or a
torch scheduler of the caller's that writes ``engine.optimizer``'s param groups."""

from __future__ import annotations

import weakref
from collections.abc import Callable

from torch import nn

from protrain.runtime.config.settings import OptimizerSettings, ScheduleSettings
from protrain.runtime.param_groups import optimizer_groups
from protrain.runtime.training.optimizer_facade import EngineOptimizer, build_engine_optimizer
from protrain.runtime.training.schedule import lr_factor


class LearningRates:
    """One engine's learning rates and its ``torch.optim`` facade (made on first use)."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: OptimizerSettings,
        schedule: ScheduleSettings,
        *,
        updates_made: Callable[[], int],
        step_applied: Callable[[], bool],
    ) -> None:
        """``step_applied``: the engine's ``was_step_applied``, held weakly (a reference back
        would make every engine a cycle, freed only by the garbage collector)."""
        self._module = module
        self._optimizer_settings = optimizer
        self._schedule = schedule
        self._updates_made = updates_made
        self._step_applied = _weak_call(step_applied)
        self._facade: EngineOptimizer | None = None
        self.from_optimizer = False
        """True: the rates are the ``lr`` of the facade's param groups, which a scheduler of the
        caller's writes (a Trainer's); the spec's schedule no longer applies, and checkpoints
        leave the learning rate to that scheduler's own state."""

    @property
    def group_lrs(self) -> tuple[float, ...]:
        """Each group's rate: the top level first, then ``optimizer.groups`` in order, every
        peak scaled by the scheduler alike (or the facade's, ``from_optimizer``)."""
        return self.facade.lrs() if self.from_optimizer else self._scheduled()

    def _scheduled(self) -> tuple[float, ...]:
        factor = lr_factor(self._updates_made(), self._schedule)
        return tuple(group.lr * factor for group in optimizer_groups(self._optimizer_settings))

    @property
    def facade(self) -> EngineOptimizer:
        """The optimizer as ``torch.optim`` code sees it (runtime.training.optimizer_facade)."""
        if self._facade is None:
            self._facade = build_engine_optimizer(
                self._module, self._optimizer_settings, lrs=self._scheduled(), step_applied=self._step_applied
            )
        return self._facade

    def moved(self) -> None:
        """The update count moved (an update, a checkpoint load): the facade shows the
        schedule's next rates, unless a scheduler of the caller's owns them."""
        if self._facade is not None and not self.from_optimizer:
            self._facade.set_lrs(self._scheduled())


def _weak_call(method: Callable[[], bool]) -> Callable[[], bool]:
    ref = weakref.WeakMethod(method)
    return lambda: bool(ref()())  # type: ignore[misc]
