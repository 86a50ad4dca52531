"""The engine's output calls: ``state_dict``, ``export`` and ``save_pretrained`` (the streaming
itself: ``from_engine.py``). Each reads the chunk manager in force where the engine holds it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.hw import device_wall
from protrain.runtime.hw.distributed import DistContext
from protrain.runtime.model_io.from_engine import export_engine, save_kind
from protrain.runtime.model_io.safetensors_stream import DEFAULT_MAX_SHARD_SIZE

KIND_WORDS = {"adapter": "PEFT adapter directory", "hf": "Hugging Face directory", "safetensors": "safetensors"}


class ChunkHolder(Protocol):
    chunks: ChunkManager


class ModelOutputs:
    """What an engine writes of its model; every rank makes each call."""

    def __init__(
        self, module: nn.Module, holder: ChunkHolder, dist_ctx: DistContext, *, log: Callable[[str], None]
    ) -> None:
        self._module = module
        self._holder = holder
        self._dist_ctx = dist_ctx
        self._log = log

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full-precision parameters and buffers by the model's own names (a tied parameter under
        each of its names), as host (CPU) tensors: the whole model in host memory at once, read
        out of its chunks one chunk at a time (the device holds one chunk and one shard buffer
        more, at most). For a model whose full precision does not fit host memory, ``export``
        streams it to files instead. Every rank calls it (the chunks are gathered) and gets it."""
        params = self._holder.chunks.full_parameters()
        result: dict[str, torch.Tensor] = {}
        for name, tensor in self._module.state_dict(keep_vars=True).items():
            if name in params:
                result[name] = params[name]
            else:
                with device_wall.host_allocations():
                    result[name] = tensor.detach().to("cpu", copy=True)
        return result

    def export(
        self,
        path: str | os.PathLike[str],
        *,
        hf: bool = False,
        adapter_only: bool = False,
        dtype: torch.dtype | None = None,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        overwrite: bool = False,
    ) -> Path:
        """Write the trained weights for use without ProTrain, streamed out of the chunks (at
        most one chunk and one shard buffer more on the device, one chunk in host memory; every
        rank calls it, rank 0 writes): safetensors at ``path`` (tied weights stored once, see
        ``runtime.model_io``; past ``max_shard_size``, Hugging Face's meaning, shards beside an
        index ``<path>.index.json``), with ``hf=True`` a Hugging Face directory for a
        transformers model, with ``adapter_only=True`` the PEFT adapter directory of a
        ``peft.PeftModel`` (what ``PeftModel.from_pretrained(base, path)`` loads; only the
        chunks holding adapter parameters are read). ``dtype`` casts floating tensors (e.g.
        ``torch.bfloat16``); default: as trained (fp32 masters). ``overwrite``: replace a
        non-empty directory."""
        if hf and adapter_only:
            raise ValueError("export: hf=True and adapter_only=True exclude each other; choose one")
        kind = "adapter" if adapter_only else "hf" if hf else "safetensors"
        target = Path(path)
        self._write(target, kind, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite, into=False)
        self._log(f"exported {KIND_WORDS[kind]} {target}")
        return target

    def save_pretrained(
        self,
        directory: str | os.PathLike[str],
        *,
        dtype: torch.dtype | None = None,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    ) -> Path:
        """What the model's own ``save_pretrained`` writes, into ``directory`` (made when missing;
        other files in it stay, the old weight files are replaced), streamed as ``export`` does:
        a PEFT model's adapters, a transformers model's config and weights, another model's
        weights as ``model.safetensors``. What a Trainer's ``save_model`` and checkpoints use."""
        kind = save_kind(self._module)
        target = Path(directory) / "model.safetensors" if kind == "safetensors" else Path(directory)
        self._write(target, kind, dtype=dtype, max_shard_size=max_shard_size, overwrite=False, into=True)
        return Path(directory)

    def _write(
        self,
        target: Path,
        kind: str,
        *,
        dtype: torch.dtype | None,
        max_shard_size: int | str,
        overwrite: bool,
        into: bool,
    ) -> None:
        export_engine(
            module=self._module,
            chunks=self._holder.chunks,
            dist_ctx=self._dist_ctx,
            target=target,
            kind=kind,
            dtype=dtype,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            into=into,
        )
