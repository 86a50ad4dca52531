"""The training state of one engine: its managers, its resources and how far it has trained.

An engine holds worker threads (side streams, the host worker), host regions (the chunk state's
arena, staging rings, the swap pool), hooks on the caller's model, activation files, a process
group, the stop-signal handlers and its claim on the device (runtime/training/live_engines.py).
``TrainingState`` holds them all, in one place, and nothing that refers to the Engine, so an
engine dropped without ``close()`` (a notebook cell run again, a Trainer nobody ended, an
exception) gives them back once it is unreachable: ``weakref.finalize`` on the Engine closes its
state. The model's hooks refer to the managers, never to the Engine, so a model kept after its
engine is dropped does not keep the engine alive.

A plan switch replaces ``chunks`` and ``activations`` here (``replace_managers``); whoever
reads them here (the checkpointer, the metrics, the trace, the finalizer) follows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from torch import nn

from protrain.runtime.activations.manager import ActivationManager
from protrain.runtime.checkpoint.checkpointer import Checkpointer, CheckpointSettings
from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.data.loaders import DataPosition
from protrain.runtime.hw.distributed import DistContext, release
from protrain.runtime.training.live_engines import EngineClaim
from protrain.runtime.training.loss_scale import DynamicLossScaler
from protrain.runtime.training.stop import StopRequest


class Closable(Protocol):
    def close(self) -> None: ...


@dataclass(slots=True)
class Progress:
    """How far training has come (saved with checkpoints)."""

    global_step: int = 0
    """Optimizer updates made (skipped updates do not count)."""
    skipped_steps: int = 0
    micro_step: int = 0
    samples_consumed: int = 0
    """Samples every rank trained on, summed over ranks and updates (skipped ones too)."""
    resumed_from: Path | None = None
    """The checkpoint this run continued from, if any."""
    torn: str | None = None
    """Why training cannot go on (a failed backward left early updates half applied)."""

    @property
    def updates(self) -> int:
        """Updates made or skipped: the number of the last window."""
        return self.global_step + self.skipped_steps


@dataclass(eq=False, kw_only=True)
class TrainingState:
    """An engine's managers and resources (see the module docstring)."""

    chunks: ChunkManager
    activations: ActivationManager
    dist_ctx: DistContext
    module: nn.Module
    checkpoint: CheckpointSettings
    seed: int
    data_position: DataPosition
    """This rank's resumable sampler (``engine.data_sampler``), saved with checkpoints."""
    loss_scaler: DynamicLossScaler | None = None
    stop: StopRequest | None = None
    claim: EngineClaim | None = None
    progress: Progress = field(default_factory=Progress)
    observers: list[Closable] = field(default_factory=list)
    """Closed before the managers (the reports, the trace, the plan controller's probe)."""
    checkpointer: Checkpointer = field(init=False)
    closed: bool = False

    def __post_init__(self) -> None:
        self.checkpointer = Checkpointer(
            holder=self, module=self.module, dist_ctx=self.dist_ctx, settings=self.checkpoint, seed=self.seed
        )

    def replace_managers(self, chunks: ChunkManager, activations: ActivationManager) -> None:
        """A plan switch's new managers (the old ones are closed already)."""
        self.chunks, self.activations = chunks, activations

    def close(self) -> None:
        """Give everything back, each part even if another fails: the observers, the stop
        handlers, an asynchronous save, the managers (threads, hooks, host regions, activation
        files), the device memory (the parameters then read as closed), the process group and
        the claim. Once; the first failure is raised after the
        rest is closed."""
        if self.closed:
            return
        self.closed = True
        with contextlib.ExitStack() as closing:  # last in, first closed
            closing.callback(self._release_claims)
            # Then the device memory, whoever still holds the engine: the next engine of the
            # process needs it, and a closed engine's parameters read as closed, not stale.
            closing.callback(self.chunks.release_device)
            closing.callback(self.chunks.close)
            closing.callback(self.activations.close)
            closing.callback(self.checkpointer.close)
            if self.stop is not None:
                closing.callback(self.stop.uninstall)
            for observer in self.observers:
                closing.callback(observer.close)

    def _release_claims(self) -> None:
        # Whatever failed before, the group and the claim go: another engine of the process may
        # still be training and must be able to close (and claim) after this one.
        try:
            release(self.dist_ctx)
        finally:
            if self.claim is not None:
                self.claim.release()


def close_dropped(state: TrainingState) -> None:
    """The finalizer of an Engine nobody closed: its state closes as ``close()`` would have
    closed it (without the stop a pending signal asks for: nobody is left to stop). It may run
    on any thread the garbage collector runs on; a failure is said, not raised (there is no
    caller to raise it to)."""
    try:
        state.close()
    except Exception as err:  # noqa: BLE001 - a finalizer has no caller
        print(f"protrain: closing an engine nobody closed failed: {err}", flush=True)
