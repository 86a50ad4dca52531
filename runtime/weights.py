"""Loading parameters from a state dict, a directory of safetensors shards, or a callable."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Union

import torch
from torch import nn

WeightsSource = Union[
    Mapping[str, torch.Tensor], str, os.PathLike, Callable[[str, torch.Tensor], torch.Tensor]
]
"""A state dict; a directory holding ``*.safetensors`` shards (as ``save_pretrained`` writes);
or ``fn(name, empty_tensor) -> tensor`` called once per parameter and buffer name."""


def load_weights_(model: nn.Module, weights: WeightsSource) -> None:
    """Copy every parameter (and every buffer ``weights`` holds) of ``model`` from ``weights``;
    missing parameters or unexpected names are an error naming them. A model built on the meta
    device (e.g. under accelerate's ``init_empty_weights``, buffers kept real) is first given
    uninitialised host storage; its real buffers are kept."""
    if any(p.is_meta for p in model.parameters()):
        _materialize_empty_(model)
    expected = model.state_dict(keep_vars=True)
    if callable(weights) and not isinstance(weights, Mapping):
        values = {name: weights(name, tensor) for name, tensor in expected.items()}
    elif isinstance(weights, (str, os.PathLike)):
        values = _read_safetensors_dir(Path(weights))
    else:
        values = dict(weights)
    _copy_into_(model, values, source=str(weights) if isinstance(weights, (str, os.PathLike)) else "weights")


def _materialize_empty_(model: nn.Module) -> None:
    """Host storage for a meta model. ``to_empty`` replaces meta parameters with new Parameter
    objects, which unties tied weights; they are tied again afterwards."""
    real_buffers = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    groups = {tuple(sorted((name, *aliases))) for name, aliases in _alias_groups(model).items() if aliases}
    model.to_empty(device="cpu")
    for group in groups:
        shared = model.get_parameter(group[0])
        for name in group[1:]:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, leaf, shared)
    # Hugging Face models built under init_empty_weights leave their declared ties undone.
    tie_weights = getattr(model, "tie_weights", None)
    if callable(tie_weights):
        tie_weights()
    with torch.no_grad():
        for name, value in real_buffers.items():
            model.get_buffer(name).copy_(value)


def _read_safetensors_dir(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not directory.is_dir():
        raise ValueError(f"weights: {directory} is not a directory of .safetensors files")
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"weights: no .safetensors files in {directory}")
    values: dict[str, torch.Tensor] = {}
    for shard in shards:
        values.update(load_file(str(shard)))
    return values


def _copy_into_(model: nn.Module, values: dict[str, torch.Tensor], *, source: str) -> None:
    expected = model.state_dict(keep_vars=True)
    # Tied weights are saved once (e.g. lm_head.weight shares wte.weight): accept either name.
    aliases = _alias_groups(model)
    buffers = {name for name, _ in model.named_buffers()}
    missing = []
    for name, target in expected.items():
        value = values.get(name)
        if value is None:
            value = next((values[alias] for alias in aliases.get(name, ()) if alias in values), None)
        if value is None:
            if name not in buffers:  # a buffer absent from a checkpoint keeps its own value
                missing.append(name)
            continue
        if value.shape != target.shape:
            raise ValueError(
                f"{source}: {name} has shape {tuple(value.shape)}, the model expects {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(value)
    unexpected = sorted(set(values) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{source}: missing {missing[:8]}{'...' if len(missing) > 8 else ''}; unexpected {unexpected[:8]}"
        )


def _alias_groups(model: nn.Module) -> dict[str, tuple[str, ...]]:
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    return {name: tuple(n for n in names if n != name) for names in by_tensor.values() for name in names}
