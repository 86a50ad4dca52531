"""Exporting trained weights for use without ProTrain.

``Engine.state_dict()`` holds consolidated full-precision parameters (gathered from every rank's
shard) and buffers by the model's own names, a tied parameter under each of its names. This
module writes that state in the two forms people load elsewhere:

- ``export_safetensors``: one ``.safetensors`` file. safetensors refuses tensors that share
  storage, so each group of tied names is stored once, under its canonical name (the name
  ``named_parameters()`` reports, e.g. ``wte.weight`` for a GPT whose ``lm_head.weight`` is tied to
  it); the dropped aliases are recorded in the file's metadata under ``protrain.tied`` as JSON
  ``{alias: canonical}``. ``load_safetensors_export`` reads the file back with every alias
  restored, so ``model.load_state_dict(load_safetensors_export(path))`` works with ``strict=True``.
  A user without ProTrain reads it with plain ``safetensors.torch.load_file`` and then either
  restores the aliases from the metadata the same way, or loads with ``strict=False``: a model
  that ties the weights itself (our GPT, Hugging Face models with ``tie_word_embeddings``) fills
  the alias through the tie, and the only missing keys reported are the aliases.
- ``export_hf``: a Hugging Face directory (``config.json``, ``model.safetensors``, the generation
  config) for a ``transformers.PreTrainedModel``, written by transformers' own ``save_pretrained``
  so its tie handling and name conventions apply; ``from_pretrained`` re-ties on load.
- ``export_adapter``: a PEFT adapter directory (``adapter_config.json``,
  ``adapter_model.safetensors``) for a ``peft.PeftModel``, written by PEFT's own
  ``save_pretrained`` from our state dict, so it holds exactly what PEFT saves (the adapters and
  ``modules_to_save``, by PEFT's names) and ``PeftModel.from_pretrained(base, path)`` loads it.

Values come only from the state dict passed in: the live model inside an engine may hold
placeholders (one NaN element seen through stride-0 views), so its parameters are never read;
the model is consulted only for names, ties and (for ``export_hf``) its class and config.

Both exports are atomic: they write to a temporary sibling (same directory, hence same file
system), flush it to disk and rename it into place, so a crash never leaves half a file under
the final name, and an error removes the temporary. Call them on one process (rank 0): the
state dict is already complete there.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from runtime.distributed import DistContext, broadcast_object
from runtime.durable import fsync_path

TIED_METADATA_KEY = "protrain.tied"
"""Metadata key of an exported file: JSON ``{alias: canonical}`` for every tied name dropped."""

_HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


# ---------------------------------------------------------------------------- one safetensors file


def export_safetensors(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    model: nn.Module | None = None,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Write ``state_dict`` to the single file ``path`` (parent folders are created); returns the
    names dropped as aliases of a tied tensor, in the state dict's order.

    Ties come from ``model`` when given (names under which ``named_parameters(
    remove_duplicate=False)`` yields the same parameter; the first name is canonical), else from
    the state dict itself (entries that are the same tensor: same storage, offset, shape, strides
    and dtype; the first one in the state dict is canonical). Other tensors that share memory are
    copied apart and stored under each name. ``dtype`` casts floating tensors (e.g.
    ``torch.bfloat16`` halves the file); ``None`` keeps them as they are (fp32 from the engine).
    ``metadata`` adds string entries to the file's header; ``protrain.tied`` is reserved."""
    _check_dtype(dtype)
    _refuse_placeholders(state_dict)
    header = _header(metadata)
    groups = _tie_groups(state_dict, model)
    aliases = {alias: names[0] for names in groups for alias in names[1:]}
    _check_ties_agree(state_dict, groups)
    tensors = _separate_shared(
        {name: _prepared(value, dtype) for name, value in state_dict.items() if name not in aliases}
    )
    if aliases:
        header[TIED_METADATA_KEY] = json.dumps(aliases, sort_keys=True)
    _write_atomically(tensors, Path(path), header)
    return [name for name in state_dict if name in aliases]


def load_safetensors_export(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a file written by ``export_safetensors`` (on the CPU) with its tied aliases restored:
    each alias is the same tensor object as its canonical entry, as in a tied model's state dict.
    A file without ``protrain.tied`` (any safetensors file) is returned as stored."""
    with safe_open(os.fspath(path), framework="pt") as handle:
        values = {name: handle.get_tensor(name) for name in handle.keys()}
        aliases = json.loads((handle.metadata() or {}).get(TIED_METADATA_KEY, "{}"))
    for alias, canonical in aliases.items():
        values[alias] = values[canonical]
    return values


def _check_dtype(dtype: torch.dtype | None) -> None:
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} is not a floating type; use e.g. torch.bfloat16, or None for fp32")


def _header(metadata: dict[str, str] | None) -> dict[str, str]:
    header = {"format": "pt"}  # what transformers checks before reading a safetensors file
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"metadata must map str to str; got {key!r}: {type(value).__name__}")
        if key == TIED_METADATA_KEY:
            raise ValueError(f"metadata key {TIED_METADATA_KEY!r} is reserved for the tied names")
        header[key] = value
    return header


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


def _prepared(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A detached, contiguous host tensor in the export dtype (no copy when nothing changes)."""
    tensor = tensor.detach()
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.to("cpu").contiguous()


def _is_placeholder(tensor: torch.Tensor) -> bool:
    """The stand-ins of ``runtime.weights.install_placeholders_``: one NaN element in memory,
    seen through stride-0 views."""
    if tensor.numel() <= 1 or not tensor.is_floating_point() or tensor.device.type == "meta":
        return False
    if tensor.untyped_storage().nbytes() > tensor.element_size():
        return False
    return bool(torch.isnan(tensor.reshape(-1)[0]))


def _separate_shared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy apart tensors that still share memory (views of one buffer that are not ties), which
    safetensors would refuse; a tensor that is alone in its memory is written as it is."""
    by_storage: dict[tuple[torch.device, int], list[str]] = {}
    for name, tensor in tensors.items():
        if tensor.numel():
            by_storage.setdefault((tensor.device, tensor.untyped_storage().data_ptr()), []).append(name)
    shared = {name for names in by_storage.values() if len(names) > 1 for name in names}
    return {name: tensor.clone() if name in shared else tensor for name, tensor in tensors.items()}


def _write_atomically(tensors: dict[str, torch.Tensor], path: Path, header: dict[str, str]) -> None:
    """Temporary file in the target's folder, fsync, rename over ``path``, fsync the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        save_file(tensors, tmp, metadata=header)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


# ------------------------------------------------------------------------- a PEFT adapter directory


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
    try:
        from peft import PeftModel
    except ImportError:
        raise TypeError("adapter_only export needs peft installed and a peft.PeftModel") from None
    if not isinstance(model, PeftModel):
        raise TypeError(
            f"adapter_only export needs a peft.PeftModel, got {type(model).__name__}; export the "
            "whole model instead (hf=True or a safetensors file)"
        )
    _check_dtype(dtype)
    target = Path(directory)
    _check_target(target, overwrite)
    _refuse_placeholders(state_dict)
    tensors = {name: _prepared(value, dtype) for name, value in state_dict.items()}

    def write(tmp: Path) -> None:
        model.save_pretrained(str(tmp), state_dict=tensors, is_main_process=True)
        if not any(tmp.rglob("adapter_model.safetensors")):
            raise RuntimeError(f"PEFT's save_pretrained wrote no adapter weights into {tmp}")

    return _write_directory(target, write)


# ---------------------------------------------------------------------- a Hugging Face directory


def export_hf(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a Hugging Face model directory that ``AutoModelForCausalLM.from_pretrained`` (or the
    model's class) loads without ProTrain; returns its path.

    ``model`` must be a ``transformers.PreTrainedModel``: its class, config and ties are used,
    never its parameter values, which come from ``state_dict`` (every parameter name of the model
    must be there). ``dtype`` casts floating tensors and is recorded as the config's ``dtype``.
    An existing non-empty ``directory`` is an error unless ``overwrite=True``, which replaces it
    whole (the old one is moved aside, then removed) once the new one is complete."""
    _require_pretrained(model)
    _check_dtype(dtype)
    target = Path(directory)
    _check_target(target, overwrite)
    tensors = _hf_state_dict(model, state_dict, dtype)

    def write(tmp: Path) -> None:
        _save_pretrained(model, tensors, tmp)
        _set_config_dtype(tmp / "config.json", _float_dtype(tensors))

    return _write_directory(target, write)


def _write_directory(target: Path, write: Callable[[Path], None]) -> Path:
    """``write`` fills a temporary sibling of ``target``; every file is flushed to disk and the
    directory renamed into place (replacing an old one only once the new one is complete); on
    any error the temporary goes and ``target`` is as it was."""
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        write(tmp)
        for path in sorted(tmp.rglob("*")):
            if path.is_file():
                fsync_path(path)
        _move_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(target.parent)
    return target


def _require_pretrained(model: nn.Module) -> None:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # then no model can be one
        pretrained: tuple[type, ...] = ()
    else:
        pretrained = (PreTrainedModel,)
    if not isinstance(model, pretrained):
        raise TypeError(
            f"export_hf needs a transformers PreTrainedModel, got {type(model).__name__}; "
            "use export_safetensors for other models"
        )


def _check_target(target: Path, overwrite: bool) -> None:
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} exists and is not a directory; choose another export directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ValueError(
            f"{target} is not empty; pass overwrite=True to replace it, or choose another directory"
        )
    target.parent.mkdir(parents=True, exist_ok=True)


def _hf_state_dict(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """Host tensors by the model's names; every name of a tied group is the same tensor, which is
    how ``save_pretrained`` recognises ties (by storage) and keeps only the canonical name."""
    expected = set(model.state_dict())
    missing = [name for name, _ in model.named_parameters(remove_duplicate=False) if name not in state_dict]
    unexpected = sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(
            f"the state dict does not match {type(model).__name__}: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}; pass this model's engine.state_dict()"
        )
    _refuse_placeholders(state_dict)
    groups = _tie_groups(state_dict, model)
    _check_ties_agree(state_dict, groups)
    tensors = {name: _prepared(value, dtype) for name, value in state_dict.items()}
    for names in groups:
        for alias in names[1:]:
            tensors[alias] = tensors[names[0]]
    return tensors


def _save_pretrained(model: nn.Module, tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """``save_pretrained`` with our values. It records the live model's dtype and class in
    ``model.config``; those two fields are put back so exporting leaves the model as it was."""
    config = model.config
    saved = {key: getattr(config, key, None) for key in ("dtype", "architectures")}
    try:
        model.save_pretrained(directory, state_dict=dict(tensors), is_main_process=True)
    finally:
        for key, value in saved.items():
            setattr(config, key, value)
    if not any((directory / name).exists() for name in _HF_WEIGHT_FILES):
        raise RuntimeError(
            f"save_pretrained wrote no weights into {directory} (under torch.distributed it writes on "
            "rank 0 only); call export_hf on rank 0"
        )


def _float_dtype(tensors: Mapping[str, torch.Tensor]) -> torch.dtype | None:
    """The dtype of the floating tensors written, when they share one."""
    dtypes = {tensor.dtype for tensor in tensors.values() if tensor.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def _set_config_dtype(config_file: Path, dtype: torch.dtype | None) -> None:
    """``save_pretrained`` records the live model's dtype, which is the placeholders' (or the
    compute dtype), not the exported one; ``from_pretrained(dtype="auto")`` reads this field."""
    if dtype is None:
        return
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _move_into_place(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``; an existing ``target`` (empty, or replaced by overwrite) is
    moved aside first and removed only after the new directory is in place."""
    if not target.exists():
        os.replace(tmp, target)
        return
    old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".old"))
    try:
        os.replace(target, old)  # onto the fresh, empty folder: a rename, not a copy
    except BaseException:
        old.rmdir()
        raise
    try:
        os.replace(tmp, target)
    except BaseException:
        os.replace(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def export_from_main_rank(
    module: nn.Module,
    state: dict[str, torch.Tensor],
    target: Path,
    *,
    hf: bool,
    dtype: torch.dtype | None,
    dist_ctx: DistContext,
    adapter_only: bool = False,
) -> None:
    """Rank 0 writes ``state`` (a safetensors file, with ``hf`` a Hugging Face directory, with
    ``adapter_only`` a PEFT adapter directory);
    every rank calls it and learns how rank 0 did (none returns before the file exists, none
    waits forever on a rank 0 that failed), and fails alike."""
    failure: BaseException | None = None
    if dist_ctx.is_main:
        try:
            if adapter_only:
                export_adapter(module, state, target, dtype=dtype)
            elif hf:
                export_hf(module, state, target, dtype=dtype)
            else:
                export_safetensors(state, target, model=module, dtype=dtype)
        except Exception as err:
            failure = err
    error = broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}", dist_ctx)
    if failure is not None:
        raise failure
    if error is not None:
        raise RuntimeError(f"export to {target} failed on rank 0: {error}")
