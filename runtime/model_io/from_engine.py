"""Exporting an engine's model straight from its chunks: ``engine.export`` and a Trainer's
``save_model``. Nothing is gathered whole: the chunks are read out one at a time
(``runtime.chunks.readout``: at most one chunk and one shard buffer more on the device, one
chunk in host memory) and each parameter goes to its file as its chunk arrives
(``runtime.model_io.safetensors_stream``). Every rank takes part in the reads (they are collectives on
several ranks); rank 0 alone writes, and every rank learns how it did.

- ``safetensors``: the model's parameters (tied ones once, under the first name; the aliases in
  the metadata, as ``export_safetensors`` writes them) and buffers, one file or shards.
- ``hf``: a Hugging Face directory: config files, the weights as ``save_pretrained`` names and
  shards them, the tied names transformers keeps.
- ``adapter``: a PEFT adapter directory; only the chunks holding adapter parameters are read.

``into`` writes a Hugging Face or adapter export into an existing directory, as
``save_pretrained`` does (a Trainer's ``checkpoint-N`` already holds other files): each file
replaced atomically, the old weight files of another shard count removed.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.chunks.readout import ChunkReadout
from protrain.runtime.hw import device_wall
from protrain.runtime.hw.distributed import DistContext, broadcast_object
from protrain.runtime.model_io.safetensors_stream import DEFAULT_MAX_SHARD_SIZE, Entry, ShardedWriter, remove_stale
from protrain.runtime.model_io.targets import (
    TIED_METADATA_KEY,
    adapter_names,
    check_dtype,
    check_target,
    export_dtype,
    hf_kept_names,
    publish_directory,
    require_peft,
    require_pretrained,
    save_adapter,
    single_float_dtype,
    staging_directory,
    write_directory,
    write_hf_config,
)

KINDS = ("safetensors", "hf", "adapter")


@dataclass(frozen=True, slots=True)
class _Selection:
    """What an export writes: names under which each parameter (by layout index) is written,
    the buffers, and the chunks to read."""

    param_names: dict[int, list[str]]
    buffers: dict[str, torch.Tensor]
    chunks: list[int]
    aliases: dict[str, str]
    """Dropped tied names -> the name written (safetensors kind)."""


def export_engine(
    *,
    module: nn.Module,
    chunks: ChunkManager,
    dist_ctx: DistContext,
    target: Path,
    kind: str,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    into: bool = False,
) -> Path:
    """Write ``module``'s weights from ``chunks`` at ``target`` (see the module docstring);
    every rank calls it; returns ``target``."""
    if kind not in KINDS:
        raise ValueError(f"export kind {kind!r}: one of {KINDS}")
    check_dtype(dtype)
    if kind == "hf":
        require_pretrained(module)
    if kind == "adapter":
        require_peft(module)
    selection = _select(module, chunks, kind)
    failure = _on_main(dist_ctx, lambda: _prepare(target, kind, overwrite, into))
    chunks.drain()
    readout = ChunkReadout(chunks.store, keep=dist_ctx.is_main)
    sink = (
        _Sink(module, selection, chunks, kind, dtype, max_shard_size) if dist_ctx.is_main and failure is None else None
    )
    try:
        if sink is not None:
            failure = sink.guard(lambda: sink.start(target, into)) or sink.guard(sink.buffers)
        for info, values in readout.chunks(selection.chunks):
            if sink is not None and failure is None and values is not None:
                failure = sink.guard(partial(sink.chunk, info.params, values))
        if sink is not None and failure is None:
            failure = sink.guard(lambda: sink.finish(target, into))
    finally:
        readout.close()
        if sink is not None and failure is not None:
            sink.abort()
    error = broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}", dist_ctx)
    if failure is not None:
        raise failure
    if error is not None:
        raise RuntimeError(f"export to {target} failed on rank 0: {error}")
    return target


def save_kind(module: nn.Module) -> str:
    """What ``save_pretrained`` writes for ``module``: a PEFT model its adapters, a transformers
    model a Hugging Face directory, anything else a safetensors file."""
    try:
        from peft import PeftModel
    except ImportError:
        PeftModel = ()  # type: ignore[assignment,misc]  # noqa: N806
    try:
        from transformers import PreTrainedModel
    except ImportError:
        PreTrainedModel = ()  # type: ignore[assignment,misc]  # noqa: N806
    if isinstance(module, PeftModel):
        return "adapter"
    return "hf" if isinstance(module, PreTrainedModel) else "safetensors"


def _on_main(dist_ctx: DistContext, action: Callable[[], None]) -> BaseException | None:
    if not dist_ctx.is_main:
        return None
    try:
        action()
    except Exception as err:
        return err
    return None


def _prepare(target: Path, kind: str, overwrite: bool, into: bool) -> None:
    if kind == "safetensors":
        target.parent.mkdir(parents=True, exist_ok=True)
    elif into:
        target.mkdir(parents=True, exist_ok=True)
    else:
        check_target(target, overwrite)


def _select(module: nn.Module, chunks: ChunkManager, kind: str) -> _Selection:
    layout = chunks.layout
    every = {i: [info.name, *info.aliases] for i, info in enumerate(layout.params)}
    shapes = {name: tuple(info.shape) for info in layout.params for name in (info.name, *info.aliases)}
    param_names = {name for names in every.values() for name in names}
    buffers = {
        name: tensor
        for name, tensor in module.state_dict(keep_vars=True).items()
        if name not in param_names and isinstance(tensor, torch.Tensor)
    }
    aliases: dict[str, str] = {}
    if kind == "adapter":
        wanted = set(adapter_names(module, {**shapes, **{n: tuple(t.shape) for n, t in buffers.items()}}))
        names = {i: [n for n in group if n in wanted] for i, group in every.items()}
        buffers = {n: t for n, t in buffers.items() if n in wanted}
    elif kind == "hf":
        kept = hf_kept_names(module, {**shapes, **{n: tuple(t.shape) for n, t in buffers.items()}})
        names = {i: [n for n in group if n in kept] for i, group in every.items()}
        buffers = {n: t for n, t in buffers.items() if n in kept}
    else:
        names = {i: [group[0]] for i, group in every.items()}
        aliases = {alias: group[0] for group in every.values() for alias in group[1:]}
    names = {i: group for i, group in names.items() if group}
    wanted_chunks = sorted({layout.slots[i].chunk for i in names})
    return _Selection(param_names=names, buffers=buffers, chunks=wanted_chunks, aliases=aliases)


class _Sink:
    """Rank 0's side: the entries in arrival order and their writer (or, for an adapter, the
    few adapter tensors gathered for PEFT's own save)."""

    def __init__(
        self,
        module: nn.Module,
        selection: _Selection,
        chunks: ChunkManager,
        kind: str,
        dtype: torch.dtype | None,
        max_shard_size: int | str,
    ) -> None:
        self.module, self.selection, self.layout, self.kind, self.dtype = module, selection, chunks.layout, kind, dtype
        self.entries = [Entry(n, export_dtype(t.dtype, dtype), tuple(t.shape)) for n, t in selection.buffers.items()]
        for chunk in selection.chunks:
            stored = chunks.chunks[chunk].stored_master().dtype
            for index in self.layout.chunks[chunk].params:
                shape = tuple(self.layout.params[index].shape)
                self.entries += [
                    Entry(n, export_dtype(stored, dtype), shape) for n in selection.param_names.get(index, [])
                ]
        self.max_shard_size = max_shard_size
        self.directory: Path | None = None
        self.staging: Path | None = None
        """The temporary directory a new Hugging Face directory is built in."""
        self.writer: ShardedWriter | None = None
        self.adapter: dict[str, torch.Tensor] = {}

    @staticmethod
    def guard(action: Callable[[], None]) -> BaseException | None:
        try:
            action()
        except Exception as err:
            return err
        return None

    def start(self, target: Path, into: bool) -> None:
        if self.kind == "adapter":
            return
        if self.kind == "safetensors":
            directory, name = target.parent, target.name
            aliases = self.selection.aliases
            metadata = {TIED_METADATA_KEY: json.dumps(aliases, sort_keys=True)} if aliases else {}
        else:
            self.staging = None if into else staging_directory(target)
            directory, name, metadata = (self.staging or target), "model.safetensors", {}
        self.directory = directory
        index = {k: v for k, v in metadata.items() if k == TIED_METADATA_KEY}
        self.writer = ShardedWriter(
            directory,
            self.entries,
            name=name,
            max_shard_size=self.max_shard_size,
            metadata=metadata,
            index_metadata=index,
        )

    def _add(self, name: str, value: torch.Tensor) -> None:
        if self.writer is not None:
            self.writer.add(name, value)
            return
        with device_wall.host_allocations():  # an adapter: its few tensors, for PEFT's save
            self.adapter[name] = value.to("cpu", dtype=export_dtype(value.dtype, self.dtype), copy=True)

    def buffers(self) -> None:
        for name, tensor in self.selection.buffers.items():
            with device_wall.host_allocations():
                host = tensor.detach().to("cpu")
            self._add(name, host)

    def chunk(self, params: tuple[int, ...] | list[int], values: torch.Tensor) -> None:
        for index in params:
            info = self.layout.params[index]
            offset = self.layout.slots[index].offset
            for name in self.selection.param_names.get(index, []):
                self._add(name, values[offset : offset + info.numel].view(info.shape))

    def finish(self, target: Path, into: bool) -> None:
        if self.writer is None:  # an adapter
            if into:
                save_adapter(self.module, self.adapter, target)
            else:
                write_directory(target, lambda directory: save_adapter(self.module, self.adapter, directory))
            return
        written = self.writer.finish()
        assert self.directory is not None
        if self.kind == "hf":
            write_hf_config(self.module, self.directory, single_float_dtype(e.dtype for e in self.entries))
        remove_stale(self.directory, self.writer.name, written)
        if self.staging is not None:
            publish_directory(self.staging, target)
            self.staging = None

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None
