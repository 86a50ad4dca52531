"""Where every parameter lives: its chunk and offset, in first-use order.

The layout is a runtime value (saved with checkpoints), keyed by parameter names, never by live
objects. Tied parameters (GPT-2's embedding and LM head) are stored once under their first name,
with the other names kept as aliases.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from protrain.profiler.chunking import ChunkTooSmallError, Packing, pack

LAYOUT_VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamInfo:
    name: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    trainable: bool

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSlot:
    chunk: int
    offset: int
    """Elements from the start of the chunk's flat buffer."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkInfo:
    index: int
    trainable: bool
    used: int
    params: tuple[int, ...]
    """Indices into ``ChunkLayout.params``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkLayout:
    """Chunks of ``chunk_numel`` elements each, sharded evenly over ``world_size`` ranks."""

    version: int = LAYOUT_VERSION
    chunk_numel: int
    world_size: int
    params: tuple[ParamInfo, ...]
    slots: tuple[ParamSlot, ...]
    chunks: tuple[ChunkInfo, ...]

    @property
    def shard_numel(self) -> int:
        return self.chunk_numel // self.world_size

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def wasted_numel(self) -> int:
        return sum(self.chunk_numel - chunk.used for chunk in self.chunks)

    def index_of(self, name: str) -> int:
        for index, info in enumerate(self.params):
            if name == info.name or name in info.aliases:
                return index
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "chunk_numel": self.chunk_numel,
            "world_size": self.world_size,
            "params": [
                {"name": p.name, "aliases": list(p.aliases), "shape": list(p.shape), "trainable": p.trainable}
                for p in self.params
            ],
            "slots": [[s.chunk, s.offset] for s in self.slots],
        }

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> ChunkLayout:
        if body.get("version") != LAYOUT_VERSION:
            raise ValueError(f"chunk layout version {body.get('version')!r} is not {LAYOUT_VERSION}")
        params = tuple(
            ParamInfo(name=p["name"], aliases=tuple(p["aliases"]), shape=tuple(p["shape"]), trainable=p["trainable"])
            for p in body["params"]
        )
        layout = layout_from_params(params, chunk_numel=body["chunk_numel"], world_size=body["world_size"])
        if [[s.chunk, s.offset] for s in layout.slots] != body["slots"]:
            raise ValueError("saved chunk layout does not match the packing of its own parameters")
        return layout


def model_params(model: nn.Module, order: list[str] | None = None) -> tuple[ParamInfo, ...]:
    """Unique parameters of ``model`` (tied ones once, aliases kept), in ``order`` when given
    (names; unlisted parameters follow in module order), else in module order."""
    names_by_tensor: dict[int, list[str]] = {}
    tensors: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_tensor.setdefault(id(param), []).append(name)
        tensors[id(param)] = param
    infos = {
        key: ParamInfo(
            name=names[0],
            aliases=tuple(names[1:]),
            shape=tuple(tensors[key].shape),
            trainable=tensors[key].requires_grad,
        )
        for key, names in names_by_tensor.items()
    }
    by_name = {name: key for key, names in names_by_tensor.items() for name in names}
    ordered: list[int] = []
    for name in order or []:
        key = by_name.get(name)
        if key is not None and key not in ordered:
            ordered.append(key)
    ordered += [key for key in names_by_tensor if key not in ordered]
    return tuple(infos[key] for key in ordered)


def first_use_order(model: nn.Module, run_forward: Callable[[], Any]) -> list[str]:
    """Parameter names in the order a forward pass first touches them (modules' own parameters,
    recorded by forward pre-hooks). Runs ``run_forward`` once under no_grad; works on meta
    tensors as well as real ones."""
    seen: set[int] = set()
    order: list[str] = []
    names = {id(p): n for n, p in model.named_parameters()}

    def record(module: nn.Module, _inputs: Any) -> None:
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                order.append(names[id(param)])

    handles = [module.register_forward_pre_hook(record) for module in model.modules()]
    try:
        with torch.no_grad():
            run_forward()
    finally:
        for handle in handles:
            handle.remove()
    return order


def layout_from_params(params: tuple[ParamInfo, ...], *, chunk_numel: int, world_size: int) -> ChunkLayout:
    try:
        packing: Packing = pack([(p.numel, p.trainable) for p in params], chunk_numel, world_size)
    except ChunkTooSmallError:
        largest = max(params, key=lambda p: p.numel)
        raise ValueError(
            f"memory.chunk_size is too small: parameter {largest.name} has {largest.numel:,} elements, "
            f"a chunk holds {chunk_numel:,}; use a chunk size of at least {largest.numel:,} elements "
            "or leave it auto"
        ) from None
    return ChunkLayout(
        chunk_numel=packing.chunk_numel,
        world_size=world_size,
        params=params,
        slots=tuple(ParamSlot(chunk=c, offset=o) for c, o in packing.placement),
        chunks=tuple(
            ChunkInfo(index=i, trainable=chunk.trainable, used=chunk.used, params=chunk.members)
            for i, chunk in enumerate(packing.chunks)
        ),
    )


def check_buffers(
    model: nn.Module, params: Sequence[nn.Parameter], layout: ChunkLayout, *, n_persist: int, n_buffer: int
) -> None:
    """ValueError naming the fix when one module needs more non-persistent chunks at once than
    there are buffer slots (its forward could never have all its parameters on the device)."""
    if all(info.index < n_persist for info in layout.chunks):
        return
    chunk_of = {id(p): layout.slots[i].chunk for i, p in enumerate(params)}
    need = 1
    owner = ""
    for name, module in model.named_modules():
        chunks = {chunk_of[id(p)] for p in module.parameters(recurse=False)}
        count = sum(1 for c in chunks if c >= n_persist)
        if count > need:
            need, owner = count, name
    if n_buffer < need:
        where = f"module {owner!r} uses {need} non-persistent chunks at once" if owner else "one is needed"
        raise ValueError(
            f"memory.n_buffer={n_buffer} is too few: {where}; set memory.n_buffer >= {need} or raise memory.n_persist"
        )
