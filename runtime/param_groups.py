"""Optimizer parameter groups: ``optimizer.groups`` resolved per parameter, and weight decay for
most parameters, none for biases and norms.

Group 0 holds the top-level values (lr, betas, weight_decay); entry ``i`` of
``optimizer.groups`` is group ``i + 1``. A parameter belongs to the first entry one of whose
shell-style patterns matches one of its names (a shared parameter has several), else to group
0. Its weight decay is its group's, or 0 when ``no_decay`` exempts it (a group's weight_decay
does not override the exemption of biases and norms).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn

from protrain.runtime.config.settings import OptimizerSettings


@dataclass(frozen=True, slots=True)
class NamedParam:
    name: str
    param: nn.Parameter


def _owner_class_names(model: nn.Module) -> dict[int, str]:
    owners: dict[int, str] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), type(module).__name__.lower())
    return owners


def is_no_decay(name: str, owner_class: str, patterns: tuple[str, ...]) -> bool:
    """True when a pattern occurs in the parameter's lower-cased name or its owner's class name."""
    lowered = name.lower()
    return any(p.lower() in lowered or p.lower() in owner_class for p in patterns)


def split_decay(model: nn.Module, patterns: tuple[str, ...]) -> tuple[list[NamedParam], list[NamedParam]]:
    """(decay, no_decay) lists of trainable parameters, each shared parameter listed once, in
    ``named_parameters`` order."""
    owners = _owner_class_names(model)
    decay: list[NamedParam] = []
    no_decay: list[NamedParam] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        target = no_decay if is_no_decay(name, owners.get(id(param), ""), patterns) else decay
        target.append(NamedParam(name, param))
    return decay, no_decay


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerGroup:
    """One parameter group's values, in the order of the groups (index 0: the top level)."""

    index: int
    match: tuple[str, ...]
    """The entry's patterns; () for the top-level group."""
    lr: float
    betas: tuple[float, float]
    weight_decay: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamHyper:
    """The groups, and per parameter (in the order given) its group and its weight decay."""

    groups: tuple[OptimizerGroup, ...]
    group_of_param: tuple[int, ...]
    weight_decay: tuple[float, ...]

    @property
    def lrs(self) -> tuple[float, ...]:
        """Each group's peak learning rate (the scheduler scales them all alike)."""
        return tuple(group.lr for group in self.groups)

    @property
    def betas(self) -> tuple[tuple[float, float], ...]:
        return tuple(group.betas for group in self.groups)


def optimizer_groups(settings: OptimizerSettings) -> tuple[OptimizerGroup, ...]:
    top = OptimizerGroup(index=0, match=(), lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay)
    entries = [
        OptimizerGroup(
            index=index,
            match=entry.match,
            lr=settings.lr if entry.lr is None else entry.lr,
            betas=settings.betas if entry.betas is None else entry.betas,
            weight_decay=settings.weight_decay if entry.weight_decay is None else entry.weight_decay,
        )
        for index, entry in enumerate(settings.groups, start=1)
    ]
    return (top, *entries)


def group_of(names: Sequence[str], groups: Sequence[OptimizerGroup]) -> int:
    """The index of the first group one of whose patterns matches one of ``names``; 0 if none."""
    for group in groups[1:]:
        if any(fnmatchcase(name, pattern) for pattern in group.match for name in names):
            return group.index
    return 0


def resolve_param_hyper(
    model: nn.Module, param_names: Sequence[Sequence[str]], settings: OptimizerSettings
) -> ParamHyper:
    """Per parameter (each given by all its names, the first the one ``named_parameters``
    lists), its group and weight decay."""
    groups = optimizer_groups(settings)
    decay, _ = split_decay(model, settings.no_decay)
    decayed = {entry.name for entry in decay}
    group_of_param = tuple(group_of(names, groups) for names in param_names)
    weight_decay = tuple(
        groups[group].weight_decay if any(n in decayed for n in names) else 0.0
        for names, group in zip(param_names, group_of_param, strict=True)
    )
    return ParamHyper(groups=groups, group_of_param=group_of_param, weight_decay=weight_decay)
