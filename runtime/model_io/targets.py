"""Where exports go: atomic directories, a Hugging Face model's config files, the names a tied
Hugging Face model keeps, a PEFT model's adapter names. Shared by the exports from a state dict
(``from_state_dict``) and from an engine's chunks (``from_engine``)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from protrain.runtime.chunks.released import names_only
from protrain.runtime.hw.durable import fsync_path

if TYPE_CHECKING:  # transformers is an optional dependency (the hf extra)
    from transformers import PreTrainedModel

TIED_METADATA_KEY = "protrain.tied"
"""Metadata key of an exported file: JSON ``{alias: canonical}`` for every tied name dropped."""


def check_dtype(dtype: torch.dtype | None) -> None:
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} is not a floating type; use e.g. torch.bfloat16, or None for fp32")


def export_dtype(tensor_dtype: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """What a tensor is written as: ``dtype`` for floating tensors when given, else as it is."""
    return dtype if dtype is not None and tensor_dtype.is_floating_point else tensor_dtype


def header(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """A file's metadata: the caller's strings (``protrain.tied`` is reserved)."""
    out: dict[str, str] = {}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"metadata must map str to str; got {key!r}: {type(value).__name__}")
        if key == TIED_METADATA_KEY:
            raise ValueError(f"metadata key {TIED_METADATA_KEY!r} is reserved for the tied names")
        out[key] = value
    return out


# ----------------------------------------------------------------------------- directories


def check_target(target: Path, overwrite: bool) -> None:
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} exists and is not a directory; choose another export directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ValueError(f"{target} is not empty; pass overwrite=True to replace it, or choose another directory")
    target.parent.mkdir(parents=True, exist_ok=True)


def write_directory(target: Path, write: Callable[[Path], None]) -> Path:
    """``write`` fills a temporary sibling of ``target``; every file is flushed to disk and the
    directory renamed into place (replacing an old one only once the new one is complete); on
    any error the temporary goes and ``target`` is as it was."""
    tmp = staging_directory(target)
    try:
        write(tmp)
        publish_directory(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def staging_directory(target: Path) -> Path:
    """A fresh temporary sibling of ``target`` to build it in (same file system: a rename)."""
    return Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))


def publish_directory(tmp: Path, target: Path) -> None:
    """Every file of ``tmp`` flushed to disk, then ``tmp`` renamed to ``target``."""
    for path in sorted(tmp.rglob("*")):
        if path.is_file():
            fsync_path(path)
    _move_into_place(tmp, target)
    fsync_path(target.parent)


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


# ----------------------------------------------------------------------------- Hugging Face


def require_pretrained(model: nn.Module) -> PreTrainedModel:
    """``model``, typed as the transformers model it must be (TypeError otherwise)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # then no model can be one
        pass
    else:
        if isinstance(model, PreTrainedModel):
            return model
    raise TypeError(
        f"export_hf needs a transformers PreTrainedModel, got {type(model).__name__}; "
        "use export_safetensors for other models"
    )


def hf_kept_names(model: nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> set[str]:
    """Of ``shapes``' names (every parameter name of ``model``, tied ones under each name), those
    ``save_pretrained`` writes: transformers' own choice of the name a tie keeps, which
    ``from_pretrained`` then expects."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # transformers 4: the first name of a tie (named_parameters' order)
        seen: set[int] = set()
        kept = set()
        for name, param in model.named_parameters(remove_duplicate=False):
            if name in meta and id(param) not in seen:
                seen.add(id(param))
                kept.add(name)
        return kept | (set(meta) - {n for n, _ in model.named_parameters(remove_duplicate=False)})
    return set(remove_tied_weights_from_state_dict(meta, require_pretrained(model)))


def write_hf_config(model: nn.Module, directory: Path, dtype: torch.dtype | None) -> None:
    """``config.json`` (with the model's class and the weights' ``dtype``), the generation
    config, and the code of a model loaded with ``trust_remote_code``: what ``save_pretrained``
    writes beside the weights, the live model's config left as it was."""
    pretrained = require_pretrained(model)
    config = copy.deepcopy(pretrained.config)
    config.architectures = [type(model).__name__]
    if getattr(model, "_auto_class", None) is not None:
        from transformers.dynamic_module_utils import custom_object_save

        # transformers annotates config as a dict; its docstring and code take a PreTrainedConfig too
        custom_object_save(model, str(directory), config=config)  # type: ignore[arg-type]
    config.save_pretrained(str(directory))
    if dtype is not None:
        path = directory / "config.json"
        values = json.loads(path.read_text(encoding="utf-8"))
        values["dtype"] = str(dtype).removeprefix("torch.")
        path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    generation_config = getattr(pretrained, "generation_config", None)
    if pretrained.can_generate() and generation_config is not None:
        generation_config.save_pretrained(str(directory))


def single_float_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype | None:
    """The floating dtype of the tensors written, when they share one."""
    floats = {dtype for dtype in dtypes if dtype.is_floating_point}
    return floats.pop() if len(floats) == 1 else None


# ----------------------------------------------------------------------------- PEFT


def require_peft(model: nn.Module) -> None:
    try:
        from peft import PeftModel
    except ImportError:
        raise TypeError("adapter_only export needs peft installed and a peft.PeftModel") from None
    if not isinstance(model, PeftModel):
        raise TypeError(
            f"adapter_only export needs a peft.PeftModel, got {type(model).__name__}; export the "
            "whole model instead (hf=True or a safetensors file)"
        )


def adapter_names(model: nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Of ``shapes``' names (the model's state-dict names), those PEFT saves for every adapter
    (the adapters and ``modules_to_save``), asked of PEFT itself on stand-ins of no memory."""
    from peft.utils import get_peft_model_state_dict

    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    original = {id(tensor): name for name, tensor in meta.items()}
    chosen: list[str] = []
    for adapter in getattr(model, "peft_config", {"default": None}):
        with names_only():  # PEFT walks modules_to_save's state_dict() for names: no values read
            picked = get_peft_model_state_dict(model, state_dict=meta, adapter_name=adapter)
        chosen += [original[id(tensor)] for tensor in picked.values() if id(tensor) in original]
    return list(dict.fromkeys(chosen))


def save_adapter(model: nn.Module, tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """PEFT's own ``save_pretrained`` of ``tensors`` (model names: PEFT renames them), so the
    directory holds what PEFT saves and ``PeftModel.from_pretrained`` loads."""
    with names_only():  # it maps ``tensors`` by the names modules_to_save's state_dict() gives
        model.save_pretrained(str(directory), state_dict=tensors, is_main_process=True)  # type: ignore[operator]
    if not any(directory.rglob("adapter_model.safetensors")):
        raise RuntimeError(f"PEFT's save_pretrained wrote no adapter weights into {directory}")
