"""Exporting a state dict the caller holds (e.g. ``engine.state_dict()`` of a small model) in the
forms people load elsewhere. The engine's own ``export`` streams from its chunks instead
(``from_engine``); both write through ``runtime.model_io.safetensors_stream``.

- ``export_safetensors``: one ``.safetensors`` file, or shards with an index past
  ``max_shard_size``. Each group of tied names is stored once, under its canonical name (the
  name ``named_parameters()`` reports, e.g. ``wte.weight`` for a GPT whose ``lm_head.weight`` is
  tied to it); the dropped aliases are recorded in the file's metadata (and the index's) under
  ``protrain.tied`` as JSON ``{alias: canonical}``. ``load_safetensors_export`` reads it back with
  every alias restored, so ``model.load_state_dict(load_safetensors_export(path))`` works with
  ``strict=True``. A user without ProTrain reads it with plain ``safetensors.torch.load_file``
  and restores the aliases from the metadata the same way, or loads with ``strict=False``: a
  model that ties the weights itself (our GPT, Hugging Face models with ``tie_word_embeddings``)
  fills the alias through the tie.
- ``export_hf``: a Hugging Face directory (``config.json``, the generation config, the weights
  as ``save_pretrained`` shards and names them, the tied names it keeps) that
  ``from_pretrained`` loads and re-ties.
- ``export_adapter``: a PEFT adapter directory written by PEFT's own ``save_pretrained`` from the
  state dict, so it holds exactly what PEFT saves and ``PeftModel.from_pretrained`` loads.

Values come only from the state dict passed in: the live model inside an engine may hold
placeholders (one NaN element seen through stride-0 views), so its parameters are never read;
the model is consulted only for names, ties and its class and config. Every write is atomic:
files under temporary names renamed into place, directories built beside their target and
renamed; an error removes the temporaries and leaves what was there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from protrain.runtime.chunks.released import released_name
from protrain.runtime.model_io.safetensors_stream import (
    DEFAULT_MAX_SHARD_SIZE,
    Entry,
    ShardedWriter,
    load_sharded,
    remove_stale,
)
from protrain.runtime.model_io.targets import (
    TIED_METADATA_KEY,
    check_dtype,
    check_target,
    export_dtype,
    header,
    hf_kept_names,
    require_peft,
    require_pretrained,
    save_adapter,
    single_float_dtype,
    write_directory,
    write_hf_config,
)


def export_safetensors(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    model: nn.Module | None = None,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> list[str]:
    """Write ``state_dict`` to ``path`` (parent folders are created): one file, or shards with
    an index when it passes ``max_shard_size``; returns the names dropped as aliases of a tied
    tensor, in the state dict's order.

    Ties come from ``model`` when given (names under which ``named_parameters(
    remove_duplicate=False)`` yields the same parameter; the first name is canonical), else from
    the state dict itself (entries that are the same tensor: same storage, offset, shape, strides
    and dtype; the first one in the state dict is canonical). ``dtype`` casts floating tensors
    (e.g. ``torch.bfloat16`` halves the file); ``None`` keeps them as they are. ``metadata`` adds
    string entries to the file's header; ``protrain.tied`` is reserved."""
    check_dtype(dtype)
    _refuse_placeholders(state_dict)
    strings = header(metadata)
    groups = _tie_groups(state_dict, model)
    aliases = {alias: names[0] for names in groups for alias in names[1:]}
    _check_ties_agree(state_dict, groups)
    if aliases:
        strings[TIED_METADATA_KEY] = json.dumps(aliases, sort_keys=True)
    kept = {name: tensor for name, tensor in state_dict.items() if name not in aliases}
    target = Path(path)
    _write(kept, target.parent, target.name, dtype, max_shard_size, strings)
    return [name for name in state_dict if name in aliases]


def load_safetensors_export(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read an export of ``export_safetensors`` or ``engine.export`` (on the CPU: one file, or
    the shards its index lists) with its tied aliases restored: each alias is the same tensor
    object as its canonical entry, as in a tied model's state dict. Any safetensors file
    without ``protrain.tied`` is returned as stored."""
    values, metadata = load_sharded(Path(path))
    for alias, canonical in json.loads(metadata.get(TIED_METADATA_KEY, "{}")).items():
        values[alias] = values[canonical]
    return values


def export_hf(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write a Hugging Face model directory that ``AutoModelForCausalLM.from_pretrained`` (or the
    model's class) loads without ProTrain; returns its path.

    ``model`` must be a ``transformers.PreTrainedModel``: its class, config and ties are used,
    never its parameter values, which come from ``state_dict`` (every parameter name of the model
    must be there). ``dtype`` casts floating tensors and is recorded as the config's ``dtype``.
    An existing non-empty ``directory`` is an error unless ``overwrite=True``, which replaces it
    whole (the old one is moved aside, then removed) once the new one is complete."""
    require_pretrained(model)
    check_dtype(dtype)
    target = Path(directory)
    check_target(target, overwrite)
    expected = set(model.state_dict(keep_vars=True))
    missing = [name for name, _ in model.named_parameters(remove_duplicate=False) if name not in state_dict]
    unexpected = sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(
            f"the state dict does not match {type(model).__name__}: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}; pass this model's engine.state_dict()"
        )
    _refuse_placeholders(state_dict)
    _check_ties_agree(state_dict, _tie_groups(state_dict, model))
    names = hf_kept_names(model, {name: tuple(tensor.shape) for name, tensor in state_dict.items()})
    kept = {name: tensor for name, tensor in state_dict.items() if name in names}
    written = single_float_dtype(export_dtype(t.dtype, dtype) for t in kept.values())

    def write(tmp: Path) -> None:
        write_hf_config(model, tmp, written)
        _write(kept, tmp, "model.safetensors", dtype, max_shard_size, {})

    return write_directory(target, write)


def export_adapter(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the adapters of a ``peft.PeftModel`` as PEFT saves them (every adapter of the model;
    one other than "default" in a subdirectory of its name, as PEFT does); returns the path.
    Values come from ``state_dict`` (the model's full names), PEFT picks the adapter entries and
    renames them. ``dtype`` casts floating tensors; ``overwrite`` as for ``export_hf``."""
    require_peft(model)
    check_dtype(dtype)
    target = Path(directory)
    check_target(target, overwrite)
    _refuse_placeholders(state_dict)
    tensors = {name: _host(value, dtype) for name, value in state_dict.items()}
    return write_directory(target, lambda tmp: save_adapter(model, tensors, tmp))


def _write(
    tensors: Mapping[str, torch.Tensor],
    directory: Path,
    name: str,
    dtype: torch.dtype | None,
    max_shard_size: int | str,
    metadata: Mapping[str, str],
) -> None:
    entries = [Entry(key, export_dtype(t.dtype, dtype), tuple(t.shape)) for key, t in tensors.items()]
    index_metadata = {k: v for k, v in metadata.items() if k == TIED_METADATA_KEY}
    writer = ShardedWriter(
        directory, entries, name=name, max_shard_size=max_shard_size, metadata=metadata, index_metadata=index_metadata
    )
    try:
        for key, tensor in tensors.items():
            writer.add(key, _host(tensor, None))
        written = writer.finish()
    except BaseException:
        writer.abort()
        raise
    remove_stale(directory, name, written)


def _host(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A detached host tensor in the export dtype (no copy when nothing changes)."""
    tensor = tensor.detach()
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.to("cpu")


def _tie_groups(state_dict: Mapping[str, torch.Tensor], model: nn.Module | None) -> list[list[str]]:
    """Groups of two or more state-dict names holding one tensor, canonical name first."""
    by_key: dict[object, list[str]] = {}
    if model is not None:
        for name, param in model.named_parameters(remove_duplicate=False):
            if name in state_dict:
                by_key.setdefault(id(param), []).append(name)
    else:
        for name, tensor in state_dict.items():
            by_key.setdefault(_identity(tensor), []).append(name)
    return [names for names in by_key.values() if len(names) > 1]


def _identity(tensor: torch.Tensor) -> object:
    """Equal for two tensors exactly when they are the same values in the same memory."""
    if tensor.numel() == 0:
        return id(tensor)  # empty tensors may all report a null storage; never a tie
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
    )


def _check_ties_agree(state_dict: Mapping[str, torch.Tensor], groups: list[list[str]]) -> None:
    """The state dict may hold a tied parameter as separate copies; they must be equal, since
    only the canonical one is written."""
    for names in groups:
        first = state_dict[names[0]]
        for alias in names[1:]:
            other = state_dict[alias]
            if other is not first and not torch.equal(other, first):
                raise ValueError(
                    f"{alias} and {names[0]} are tied in the model but differ in the state dict; "
                    "pass the state dict of this model (engine.state_dict())"
                )


def _refuse_placeholders(state_dict: Mapping[str, torch.Tensor]) -> None:
    """Checked first: placeholders all look alike (same memory, shape, strides) and would
    otherwise be taken for ties."""
    for name, tensor in state_dict.items():
        if _is_placeholder(tensor):
            raise ValueError(
                f"{name} is a placeholder (ProTrain's live model holds no values); "
                "export engine.state_dict(), not engine.module.state_dict()"
            )


def _is_placeholder(tensor: torch.Tensor) -> bool:
    """The stand-ins of ``runtime.model_io.weights.install_placeholders_``: one NaN element in memory,
    seen through stride-0 views."""
    if released_name(tensor) is not None:
        return True
    if tensor.numel() <= 1 or not tensor.is_floating_point() or tensor.device.type == "meta":
        return False
    if tensor.untyped_storage().nbytes() > tensor.element_size():
        return False
    return bool(torch.isnan(tensor.reshape(-1)[0]))
