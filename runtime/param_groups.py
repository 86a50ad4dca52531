"""Optimizer parameter groups: weight decay for most parameters, none for biases and norms."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


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


def build_adamw(
    model: nn.Module,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    no_decay: tuple[str, ...],
) -> torch.optim.AdamW:
    decay, exempt = split_decay(model, no_decay)
    groups = [
        {"params": [p.param for p in decay], "weight_decay": weight_decay, "names": [p.name for p in decay]},
        {"params": [p.param for p in exempt], "weight_decay": 0.0, "names": [p.name for p in exempt]},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)
