"""The Engine's facades, around its call protocol: DeepSpeed-style accessors, the model's state
dict, data loaders whose position checkpoints save, checkpoints, and export.

``EngineFacades`` is the base class of ``runtime.training.engine.Engine`` and holds nothing of its own: it
reads the attributes the Engine sets (declared below), so that ``engine.py`` stays the call
protocol (forward, backward, step) and the plan in force.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from protrain.runtime.activations.manager import ActivationManager
from protrain.runtime.checkpoint.checkpointer import Checkpointer
from protrain.runtime.checkpoint.store import Checkpoint, CheckpointError
from protrain.runtime.chunks.gathered import gathered
from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.config.settings import TrainingSettings
from protrain.runtime.console import ProgressReporter
from protrain.runtime.hw import device_wall
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.distributed import DistContext
from protrain.runtime.loaders import DataPosition
from protrain.runtime.param_groups import optimizer_groups
from protrain.runtime.safetensors_stream import DEFAULT_MAX_SHARD_SIZE
from protrain.runtime.sampler import ShardedSampler
from protrain.runtime.training.loss_scale import DynamicLossScaler
from protrain.runtime.training.optimizer_facade import EngineOptimizer, build_engine_optimizer
from protrain.runtime.training.parts import EngineParts
from protrain.runtime.training.schedule import lr_factor

_E = TypeVar("_E", bound="EngineFacades")
_F = TypeVar("_F", bound=Callable[..., Any])


def _weak_call(method: Callable[[], bool]) -> Callable[[], bool]:
    """``method`` without keeping its engine alive (the optimizer facade outlives no engine, but
    a reference back would make every engine a cycle, freed only by the garbage collector)."""
    ref = weakref.WeakMethod(method)
    return lambda: bool(ref()())  # type: ignore[misc]


def device_call(operation: str) -> Callable[[_F], _F]:
    """An engine call: what it allocates on the device counts to the engine's budget under the
    device wall (runtime/hw/device_wall.py), whoever allocates it."""

    def wrap(method: _F) -> _F:
        @functools.wraps(method)
        def call(self: EngineFacades, *args: Any, **kwargs: Any) -> Any:
            with device_wall.engine_call(self._wall, f"engine.{operation}"):
                return method(self, *args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap


class EngineFacades:
    """Accessors, state dict, data, checkpoints and export of an Engine."""

    module: nn.Module
    settings: TrainingSettings
    dist_ctx: DistContext
    device_info: DeviceInfo
    _parts: EngineParts
    data_position: DataPosition
    loss_scaler: DynamicLossScaler | None
    global_step: int
    skipped_steps: int
    samples_consumed: int
    micro_step: int
    resumed_from: Path | None
    _torn: str | None
    _window_steps: int
    """Micro-batches ``step()`` counted in the window in progress."""
    _boundary: bool | None
    """The caller's end-of-window signal (``set_gradient_accumulation_boundary``)."""
    _backward_closes: bool | None
    """Whether the last backward was its window's last (it started the early updates); None
    once its ``step()`` counted it."""
    _step_applied: bool
    _global_grad_norm: float | None = None

    lr_from_optimizer: bool = False
    """True: the learning rates are the ``lr`` of ``engine.optimizer``'s param groups, which a
    scheduler of the caller's writes (a Trainer's); the spec's schedule no longer applies, and
    checkpoints leave the learning rate to that scheduler's own state."""
    _optimizer: EngineOptimizer | None = None

    _reporter: ProgressReporter
    _wall: device_wall.Account | None = None
    """This engine's count under the device wall (None: the wall is down)."""

    def log(self, text: str) -> None:
        """Print on rank 0 only."""
        self._reporter.print(text)

    # ---------------------------------------------------------------- accessors

    @property
    def chunks(self) -> ChunkManager:
        """The chunk manager of the plan in force (a plan switch replaces it)."""
        return self._parts.chunks

    def gathered(
        self, params: Iterable[nn.Parameter], *, modify: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        """``with engine.gathered(model.lm_head.parameters()):`` the parameters hold their values
        on the device for the block, wherever it reads them (DeepSpeed's ``GatheredParameters``):
        for code that reads a weight outside the forward of the module that owns it, which is
        refused otherwise while its chunk is offloaded. Gradients of a differentiable use take
        the usual path. ``modify=True`` keeps what the block wrote (rank 0's values) in the fp32
        masters. Every rank enters it, in the same order (runtime/chunks/gathered.py)."""
        return gathered(self.chunks, params, modify=modify)

    @property
    def activations(self) -> ActivationManager:
        return self._parts.activations

    @property
    def checkpointer(self) -> Checkpointer:
        return self._parts.checkpointer

    @property
    def device(self) -> torch.device:
        return self.device_info.device

    @property
    def rank(self) -> int:
        return self.dist_ctx.rank

    @property
    def world_size(self) -> int:
        return self.dist_ctx.world_size

    @property
    def micro_batch_size(self) -> int:
        return self.settings.micro_batch_size

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.settings.gradient_accumulation_steps

    @property
    def lr(self) -> float:
        """The learning rate of the next update (the top-level one; ``group_lrs`` has each)."""
        return self.group_lrs[0]

    @property
    def group_lrs(self) -> tuple[float, ...]:
        """Each parameter group's learning rate for the next update: the top level first, then
        ``optimizer.groups`` in order, every peak scaled by the scheduler alike; with
        ``lr_from_optimizer``, the ``lr`` of ``engine.optimizer``'s groups."""
        if self.lr_from_optimizer:
            return self.optimizer.lrs()
        return self._scheduled_lrs()

    def _scheduled_lrs(self) -> tuple[float, ...]:
        factor = lr_factor(self.global_step, self.settings.schedule)
        return tuple(group.lr * factor for group in optimizer_groups(self.settings.optimizer))

    @property
    def optimizer(self) -> EngineOptimizer:
        """The optimizer as ``torch.optim`` code sees it: one param group per optimizer group
        (see ``runtime.training.optimizer_facade``); made on first use."""
        if self._optimizer is None:
            self._optimizer = build_engine_optimizer(
                self.module,
                self.settings.optimizer,
                lrs=self._scheduled_lrs(),
                step_applied=_weak_call(self.was_step_applied),
            )
        return self._optimizer

    def _lrs_updated(self) -> None:
        """After an update: the facade shows the spec schedule's next learning rates (unless a
        scheduler of the caller's owns them)."""
        if self._optimizer is not None and not self.lr_from_optimizer:
            self._optimizer.set_lrs(self._scheduled_lrs())

    # ---------------------------------------------------------------- the accumulation window

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` call will update the parameters: the caller's signal
        when it gave one, else at every gradient_accumulation_steps-th micro-batch."""
        if self._boundary is not None:
            return self._boundary
        return self._window_steps + 1 >= self.settings.gradient_accumulation_steps

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """DeepSpeed's end-of-window signal: True, the coming micro-batch ends the window whatever
        its length (a Trainer's last window of an epoch can be short); False, it does not; None,
        count gradient_accumulation_steps again. It holds until changed; set it before the
        micro-batch's backward (the window's last backward starts its early updates)."""
        self._boundary = is_boundary

    def _closes_window(self) -> bool:
        """Whether the ``step()`` being made ends the window, as its backward was told."""
        closes = self.is_gradient_accumulation_boundary()
        if self._backward_closes is not None and closes != self._backward_closes:
            raise RuntimeError(
                "the accumulation boundary changed between backward and step: call "
                "set_gradient_accumulation_boundary before the micro-batch's backward"
            )
        return closes

    def was_step_applied(self) -> bool:
        """Whether the last update changed the parameters (False: skipped for a non-finite loss
        or an fp16 overflow, or no update yet), as DeepSpeed's ``was_step_applied``."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last update, before clipping (DeepSpeed's name);
        None when it was not taken (no clipping, no fp16 loss scaling: it costs a pass)."""
        return self._global_grad_norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do between windows (each update drops its window's gradients), where
        training loops call it; in the middle of a window it raises rather than drop part of it."""
        if self._window_steps != 0 or self._backward_closes is not None:
            raise RuntimeError(
                "zero_grad in the middle of an accumulation window: the engine drops a window's "
                "gradients itself after its update"
            )

    # ---------------------------------------------------------------- using the model

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The model's parameters (chunk-managed: one not on the device may be empty)."""
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse)

    def train(self: _E, mode: bool = True) -> _E:
        self.module.train(mode)
        return self

    def eval(self: _E) -> _E:
        self.module.eval()
        return self

    @device_call("state_dict")
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full-precision parameters and buffers by the model's own names (a tied parameter under
        each of its names), as host (CPU) tensors: the whole model in host memory at once, read
        out of its chunks one chunk at a time (the device holds one chunk and one shard buffer
        more, at most). For a model whose full precision does not fit host memory, ``export``
        streams it to files instead. Every rank calls it (the chunks are gathered) and gets it."""
        params = self.chunks.full_parameters()
        result: dict[str, torch.Tensor] = {}
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            if name in params:
                result[name] = params[name]
            else:
                with device_wall.host_allocations():
                    result[name] = tensor.detach().to("cpu", copy=True)
        return result

    @device_call("export")
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
        ``runtime.export``; past ``max_shard_size``, Hugging Face's meaning, shards beside an
        index ``<path>.index.json``), with ``hf=True`` a Hugging Face directory for a
        transformers model, with ``adapter_only=True`` the PEFT adapter directory of a
        ``peft.PeftModel`` (what ``PeftModel.from_pretrained(base, path)`` loads; only the
        chunks holding adapter parameters are read). ``dtype`` casts floating tensors (e.g.
        ``torch.bfloat16``); default: as trained (fp32 masters). ``overwrite``: replace a
        non-empty directory."""
        from protrain.runtime.export.from_engine import export_engine

        if hf and adapter_only:
            raise ValueError("export: hf=True and adapter_only=True exclude each other; choose one")
        kind = "adapter" if adapter_only else "hf" if hf else "safetensors"
        target = Path(path)
        export_engine(
            module=self.module,
            chunks=self.chunks,
            dist_ctx=self.dist_ctx,
            target=target,
            kind=kind,
            dtype=dtype,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
        )
        words = {"adapter": "PEFT adapter directory", "hf": "Hugging Face directory", "safetensors": "safetensors"}
        self.log(f"exported {words[kind]} {target}")
        return target

    @device_call("save_pretrained")
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
        from protrain.runtime.export.from_engine import export_engine, save_kind

        kind = save_kind(self.module)
        target = Path(directory) / "model.safetensors" if kind == "safetensors" else Path(directory)
        export_engine(
            module=self.module,
            chunks=self.chunks,
            dist_ctx=self.dist_ctx,
            target=target,
            kind=kind,
            dtype=dtype,
            max_shard_size=max_shard_size,
            into=True,
        )
        return Path(directory)

    # ---------------------------------------------------------------- data

    def data_sampler(self, num_samples: int, *, shuffle: bool = True) -> ShardedSampler:
        """A sampler over a dataset of ``num_samples`` for this rank (batch size
        ``micro_batch_size``) whose position is saved with every checkpoint and restored on
        resume, so a resumed run sees exactly the batches the uninterrupted run would have. Give
        the DataLoader a ``generator`` of its own, or use ``data_loader``."""
        return self.data_position.make_sampler(num_samples, shuffle=shuffle)

    def data_loader(self, dataset: Dataset[Any], **loader_args: Any) -> DataLoader[Any]:
        """A ``DataLoader`` over ``dataset`` with this rank's resumable ``data_sampler`` and
        ``micro_batch_size``; other arguments (``num_workers``, ``collate_fn``...) pass through.
        It draws its worker seeds from a generator of its own: a plain DataLoader draws them from
        the global random stream each time it starts an epoch, so a resumed run, which starts
        one at a different step, would see different dropout masks than the uninterrupted run."""
        return self.data_position.make_loader(dataset, **loader_args)

    # ---------------------------------------------------------------- checkpoints

    @device_call("save_checkpoint")
    def save_checkpoint(self, directory: str | os.PathLike[str] | None = None) -> Path:
        """Save the training state as ``<directory>/step-<global_step>`` (default: the spec's
        ``checkpoint.dir``); every rank calls it, between updates. Returns the checkpoint's path
        (with ``async_save``, where it will be once written)."""
        root = Path(directory) if directory is not None else self.checkpointer.settings.dir
        if root is None:
            raise ValueError("save_checkpoint needs a directory: pass one or set checkpoint.dir")
        if self._window_steps != 0:
            raise RuntimeError(
                "save_checkpoint in the middle of an accumulation window: call it after engine.step() "
                "has updated the parameters"
            )
        path = self.checkpointer.save(Path(root), step=self.global_step, trainer_state=self._trainer_state())
        background = " (being written in the background)" if self.checkpointer.settings.async_save else ""
        self.log(f"checkpoint {path}{background}")
        return path

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "skipped_steps": self.skipped_steps,
            "samples_consumed": self.samples_consumed,
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
            "data": self.data_position.state_dict(),
            "seed": self.settings.seed,
            "precision": self.settings.precision.value,
        }

    @device_call("load_checkpoint")
    def load_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Continue from a checkpoint: ``path`` is one checkpoint directory or a checkpoint root
        (its latest complete checkpoint is taken). Parameters, Adam state, step counts, loss
        scale, random streams and data position are restored; the world size may differ."""
        return self._load(self.checkpointer.locate(Path(path)))

    @device_call("resume")
    def resume(self) -> Path | None:
        """What ``initialize`` does with ``checkpoint.resume``: auto loads the latest complete
        checkpoint in ``checkpoint.dir`` if there is one, a path loads that, never nothing."""
        settings = self.checkpointer.settings
        if settings.resume == "never":
            return None
        if settings.resume != "auto":
            return self.load_checkpoint(settings.resume)
        if settings.dir is None:
            return None
        found = self.checkpointer.latest(settings.dir)
        return None if found is None else self._load(found)

    def _load(self, checkpoint: Checkpoint) -> Path:
        if self._window_steps != 0:
            raise RuntimeError("load_checkpoint in the middle of an accumulation window")
        manifest = self.checkpointer.load(checkpoint, log=self.log)
        self._torn = None  # every parameter and moment comes from the checkpoint again
        try:
            self.global_step = int(manifest["global_step"])
            self.skipped_steps = int(manifest["skipped_steps"])
            self.samples_consumed = int(manifest["samples_consumed"])
            scaler = manifest["loss_scaler"]
            data = manifest["data"]
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{checkpoint.path}: manifest lacks {err}") from err
        if self.loss_scaler is not None and scaler is not None:
            self.loss_scaler.load_state_dict(scaler)
        self.data_position.load_state_dict(data)
        self._lrs_updated()  # the update count moved: the facade shows the schedule's next rates
        self.resumed_from = checkpoint.path
        self.log(f"resumed from {checkpoint.path} (update {self.global_step})")
        return checkpoint.path
