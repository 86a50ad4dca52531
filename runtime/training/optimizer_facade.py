"""The engine's optimizer as ``torch.optim`` code sees it (DeepSpeed: ``engine.optimizer``).

``EngineOptimizer`` is a ``torch.optim.Optimizer`` whose parameter groups are the engine's
optimizer groups (group 0 the top level, then ``optimizer.groups`` in order), each holding its
trainable parameters and its ``lr``, ``betas``, ``eps`` and ``weight_decay`` (and for sgd
``momentum``, ``dampening`` and ``nesterov``, as ``torch.optim.SGD``'s groups do). It updates
nothing itself: the engine's ``step()`` runs the optimizer rule on the chunk shards. It exists so that a learning-rate
scheduler written for torch (``LambdaLR``, transformers' ``get_scheduler``) can own the learning
rate: with ``engine.lr_from_optimizer = True`` the ``lr`` of each group here is what the next
update uses; otherwise the engine writes its own schedule's values here after every update and
every checkpoint load, so reading them is always right. Betas, eps and weight decay stay the
spec's (changing them here changes nothing; they are shown for code that reads them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from protrain.runtime.config.settings import OptimizerSettings
from protrain.runtime.param_groups import OptimizerGroup, resolve_param_hyper


class EngineOptimizer(torch.optim.Optimizer):
    """Parameter groups over the engine's; ``step()`` and ``zero_grad()`` do nothing."""

    def __init__(
        self,
        groups: Sequence[OptimizerGroup],
        params_of_group: Sequence[Sequence[nn.Parameter]],
        *,
        eps: float,
        lrs: Sequence[float],
        step_applied: Callable[[], bool],
        rule_values: dict[str, Any] | None = None,
    ) -> None:
        """``params_of_group[i]``: the trainable parameters of group ``i`` (each once; a group
        may be empty); ``lrs``: each group's learning rate for the next update;
        ``step_applied``: whether the engine's last update changed the parameters;
        ``rule_values``: the rule's own values, in every group."""
        param_groups: list[dict[str, Any]] = [
            {
                "params": list(params),
                "lr": lr,
                # The peak: what a torch scheduler made now scales (it reads initial_lr first).
                "initial_lr": group.lr,
                "betas": group.betas,
                "eps": eps,
                "weight_decay": group.weight_decay,
                "match": group.match,
                **(rule_values or {}),
            }
            for group, params, lr in zip(groups, params_of_group, lrs, strict=True)
        ]
        if not any(group["params"] for group in param_groups):
            # torch refuses an optimizer without parameters; say why in the engine's terms.
            raise ValueError("the engine has no trainable parameter: there is nothing to optimize")
        super().__init__(param_groups, defaults={})
        self._step_applied = step_applied

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Nothing: the engine's ``step()`` updated the parameters at the window's end."""
        if closure is not None:
            raise ValueError("the engine's optimizer takes no closure: engine.step() updates the parameters")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine drops each window's gradients after its update."""

    @property
    def step_was_skipped(self) -> bool:
        """True when the engine's last update was skipped (a non-finite loss, an fp16
        overflow): the name accelerate gives the flag a Trainer reads to hold its scheduler."""
        return not self._step_applied()

    def lrs(self) -> tuple[float, ...]:
        """Each group's ``lr``, as a scheduler last wrote it."""
        return tuple(float(group["lr"]) for group in self.param_groups)

    def set_lrs(self, lrs: Sequence[float]) -> None:
        for group, lr in zip(self.param_groups, lrs, strict=True):
            group["lr"] = lr


def build_engine_optimizer(
    module: nn.Module, settings: OptimizerSettings, *, lrs: Sequence[float], step_applied: Callable[[], bool]
) -> EngineOptimizer:
    """The facade over ``module``'s trainable parameters, grouped as the engine groups them (a
    shared parameter once, matched through any of its names)."""
    names_of: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            names_of.setdefault(id(param), []).append(name)
            params.setdefault(id(param), param)
    hyper = resolve_param_hyper(module, [names_of[key] for key in params], settings)
    members: list[list[nn.Parameter]] = [[] for _ in hyper.groups]
    for param, group in zip(params.values(), hyper.group_of_param, strict=True):
        members[group].append(param)
    sgd = {"momentum": settings.momentum, "dampening": settings.dampening, "nesterov": settings.nesterov}
    return EngineOptimizer(
        hyper.groups,
        members,
        eps=settings.eps,
        lrs=lrs,
        step_applied=step_applied,
        rule_values=sgd if settings.type == "sgd" else None,
    )
