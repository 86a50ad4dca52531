"""Loading parameters from a state dict, a directory of safetensors shards, or a callable.

A real model is filled in place (``load_weights_``). A model built on the meta device is never
materialised whole: ``install_placeholders_`` gives its parameters shape-only stand-ins, and the
chunk engine reads each parameter from a ``WeightReader`` straight into its chunk, one at a time
(safetensors shards are opened lazily and read tensor by tensor).
"""

from __future__ import annotations

import contextlib
import copy
import os
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

WeightsSource = Mapping[str, torch.Tensor] | str | os.PathLike | Callable[[str, torch.Tensor], torch.Tensor]
"""A state dict; a directory holding ``*.safetensors`` shards (as ``save_pretrained`` writes);
or ``fn(name, empty_tensor) -> tensor`` called once per parameter and buffer name."""


class ModelInit:
    """A weights source (``fn(name, empty) -> tensor``) that gives each parameter of a model
    built on the meta device the value its own construction would: the owning module's
    ``reset_parameters()`` (torch's default init) then the model's ``_init_weights(module)``
    (what ``model.apply(model._init_weights)`` does for the repo's GPT and ``post_init`` does for
    Hugging Face models). Each parameter draws from the global generator seeded by (``seed``,
    its name), so every rank gets the same values whatever order the chunks are filled in, and
    only the one parameter asked for is ever allocated. The values are not those of the model
    built whole under ``torch.manual_seed(seed)`` (that draws from one stream in module order).

    A parameter neither initialiser writes (a custom ``nn.Parameter``) is an error naming it:
    it would otherwise train from uninitialised memory."""

    def __init__(self, model: nn.Module, *, seed: int) -> None:
        if not all(p.is_meta for p in model.parameters()):
            raise ValueError("ModelInit initialises a model built on the meta device (init_empty_weights)")
        # The initialisers run on a private copy (its parameters meta, so copying costs nothing):
        # initialize swaps the model's own parameters for stand-ins and chunk views, which an
        # initialiser reaching past its module (a reset of a submodule) must never write into.
        self._template = copy.deepcopy(model)
        self._init_module = getattr(self._template, "_init_weights", None)
        self._seed = seed

    def __call__(self, name: str, empty: torch.Tensor) -> torch.Tensor:
        owner_name, _, leaf = name.rpartition(".")
        owner = self._template.get_submodule(owner_name) if owner_name else self._template
        meta = owner._parameters.get(leaf)
        if meta is None:
            raise ValueError(
                f"model init: {name} is not a parameter of the model; a meta buffer? build the model "
                "under init_empty_weights(include_buffers=False)"
            )
        value = torch.full(tuple(empty.shape), float("nan"), dtype=empty.dtype)
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(self.seed_for(name))
                reset = getattr(owner, "reset_parameters", None)
                if callable(reset):
                    reset()
                if self._init_module is not None:
                    self._init_module(owner)
        finally:
            owner._parameters[leaf] = meta  # the copy keeps no real memory between calls
        if torch.isnan(value).any():
            raise ValueError(
                f"model init: neither {type(owner).__name__}.reset_parameters nor the model's "
                f"_init_weights sets {name}; pass the weights instead (e.g. a safetensors directory)"
            )
        return value

    def seed_for(self, name: str) -> int:
        """The generator seed of parameter ``name``: the job's seed and a checksum of the name."""
        return (self._seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63)


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


class WeightReader:
    """Reads one parameter (or buffer) at a time from a weights source, by the model's names
    (a tied parameter under any of its names). Names are checked up front: missing parameters
    and unexpected entries are an error naming them, before anything is read."""

    def __init__(self, weights: WeightsSource, model: nn.Module) -> None:
        # Hugging Face models built under init_empty_weights leave their declared ties undone.
        tie_weights = getattr(model, "tie_weights", None)
        if callable(tie_weights):
            tie_weights()
        self.source = str(weights) if isinstance(weights, (str, os.PathLike)) else "weights"
        self._aliases = _alias_groups(model)
        self._expected = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict(keep_vars=True).items()}
        self._callable: Callable[[str, torch.Tensor], torch.Tensor] | None = None
        self._mapping: Mapping[str, torch.Tensor] | None = None
        self._files: dict[str, Path] = {}
        if callable(weights) and not isinstance(weights, Mapping):
            self._callable = weights
            self._empty = dict(model.state_dict(keep_vars=True))
            available = set(self._expected)
        elif isinstance(weights, (str, os.PathLike)):
            self._files = _safetensors_index(Path(weights))
            available = set(self._files)
        else:
            self._mapping = weights
            available = set(weights)
        buffers = {name for name, _ in model.named_buffers()}
        missing = [name for name in self._expected if name not in buffers and self._resolve(name, available) is None]
        unexpected = sorted(available - set(self._expected))
        if missing or unexpected:
            raise ValueError(
                f"{self.source}: missing {missing[:8]}{'...' if len(missing) > 8 else ''}; unexpected {unexpected[:8]}"
            )
        self._available = available

    def has(self, name: str) -> bool:
        return self._resolve(name, self._available) is not None

    def get(self, name: str) -> torch.Tensor:
        """The value of ``name`` (checked against the model's shape)."""
        key = self._resolve(name, self._available)
        if key is None:
            raise KeyError(f"{self.source}: no value for {name}")
        if self._callable is not None:
            value = self._callable(name, self._empty[name])
        elif self._mapping is not None:
            value = self._mapping[key]
        else:
            from safetensors import safe_open

            with safe_open(str(self._files[key]), framework="pt") as shard:
                value = shard.get_tensor(key)
        shape = self._expected[name][0]
        if tuple(value.shape) != shape:
            raise ValueError(f"{self.source}: {name} has shape {tuple(value.shape)}, the model expects {shape}")
        return value

    def _resolve(self, name: str, available: set[str]) -> str | None:
        if name in available:
            return name
        return next((alias for alias in self._aliases.get(name, ()) if alias in available), None)


def held_on(model: nn.Module, device: torch.device) -> bool:
    """Whether every parameter of ``model`` is on ``device`` (so the model can run whole there):
    on the CPU any materialised model; on a GPU only one the caller moved there itself."""
    return all(param.device == device for param in model.parameters())


def _stand_in(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A shape-only stand-in for ``like`` on ``device``: one NaN element seen through a stride-0
    view (no memory; any stray read shows as NaN)."""
    nan = torch.full((1,), float("nan"), dtype=like.dtype, device=device)
    return nan.expand(like.shape) if like.dim() else nan[0]


@contextlib.contextmanager
def stand_ins(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Every parameter's data swapped for a stand-in on ``device`` for the duration, then put
    back: a model held in host memory can then run a forward on the device (to record the
    order it uses its parameters in) without its weights ever moving there. The ``Parameter``
    objects stay the same, so tied parameters stay tied."""
    held = {id(param): (param, param.data) for param in model.parameters()}
    try:
        for param, data in held.values():
            param.data = _stand_in(data, device)
        yield
    finally:
        for param, data in held.values():
            param.data = data


def move_buffers_(model: nn.Module, device: torch.device) -> None:
    """Every buffer of ``model`` (normalisation statistics, rotary caches: small) onto
    ``device``; the parameters stay where they are. A buffer shared by two modules stays shared."""
    moved: dict[int, torch.Tensor] = {}
    for name, buffer in list(model.named_buffers(remove_duplicate=False)):
        if id(buffer) not in moved:
            moved[id(buffer)] = buffer.to(device)
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[leaf] = moved[id(buffer)]


def install_placeholders_(model: nn.Module, device: torch.device, reader: WeightReader) -> None:
    """Give a meta model's parameters shape-only stand-ins on ``device`` (see ``_stand_in``),
    keeping tied parameters tied; real buffers move to ``device`` and meta buffers are read from
    ``reader``."""
    replaced: dict[int, nn.Parameter] = {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        stand_in = replaced.get(id(param))
        if stand_in is None:
            view = _stand_in(param, device)
            stand_in = replaced[id(param)] = nn.Parameter(view, requires_grad=param.requires_grad)
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf, stand_in)
    for name, buffer in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if buffer.is_meta:
            if not reader.has(name):
                raise ValueError(f"{reader.source}: buffer {name} is on the meta device and not in the weights")
            module._buffers[leaf] = reader.get(name).to(device=device, dtype=buffer.dtype)
        else:
            module._buffers[leaf] = buffer.to(device)


def _safetensors_index(directory: Path) -> dict[str, Path]:
    """Tensor name -> the shard holding it (headers only; nothing is read)."""
    from safetensors import safe_open

    if not directory.is_dir():
        raise ValueError(f"weights: {directory} is not a directory of .safetensors files")
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"weights: no .safetensors files in {directory}")
    index: dict[str, Path] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            for key in handle.keys():
                index[key] = shard
    return index


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


def weight_reader(model: nn.Module, weights: WeightsSource | None) -> WeightReader | None:
    """The reader of a model built on the meta device: it is never materialised whole, its
    parameters get stand-ins and each is read from the weights straight into its chunk. Weights
    for a materialised model are loaded into it now."""
    streamed = weights is not None and any(p.is_meta for p in model.parameters())
    reader = WeightReader(weights, model) if streamed and weights is not None else None
    if weights is not None and reader is None:
        load_weights_(model, weights)
    if reader is None:
        refuse_meta(model)
    return reader


def refuse_meta(model: nn.Module) -> None:
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(
            f"{len(meta)} parameters (e.g. {meta[0]}) are on the meta device and no weights were "
            "given; pass initialize(..., weights=...) with a state dict, a safetensors directory "
            "or a callable"
        )
