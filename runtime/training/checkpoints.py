"""The engine's checkpoint calls: save, load and resume its training state (what the files hold
and how they are written: ``runtime.checkpoint``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protrain.runtime.checkpoint.store import Checkpoint, CheckpointError
from protrain.runtime.config.settings import TrainingSettings
from protrain.runtime.training.state import TrainingState
from protrain.runtime.training.window import AccumulationWindow


class TrainingCheckpoints:
    """Checkpoints of one engine's ``TrainingState``; every rank makes each call, between updates."""

    def __init__(
        self,
        state: TrainingState,
        window: AccumulationWindow,
        settings: TrainingSettings,
        *,
        moved: Callable[[], None],
        log: Callable[[str], None],
    ) -> None:
        """``moved``: called when a load changed the update count (the learning rates follow)."""
        self._state = state
        self._window = window
        self._settings = settings
        self._moved = moved
        self._log = log

    def save_checkpoint(self, directory: str | os.PathLike[str] | None = None) -> Path:
        """Save the training state as ``<directory>/step-<global_step>`` (default: the spec's
        ``checkpoint.dir``); every rank calls it, between updates. Returns the checkpoint's path
        (with ``async_save``, where it will be once written)."""
        checkpointer = self._state.checkpointer
        root = Path(directory) if directory is not None else checkpointer.settings.dir
        if root is None:
            raise ValueError("save_checkpoint needs a directory: pass one or set checkpoint.dir")
        self._window.refuse_inside("save_checkpoint", ": call it after engine.step() has updated the parameters")
        progress = self._state.progress
        path = checkpointer.save(Path(root), step=progress.global_step, trainer_state=self._trainer_state())
        background = " (being written in the background)" if checkpointer.settings.async_save else ""
        self._log(f"checkpoint {path}{background}")
        return path

    def due(self) -> bool:
        """Whether the update just made is one ``checkpoint.interval_steps`` saves after."""
        settings = self._state.checkpointer.settings
        interval = settings.interval_steps
        return settings.dir is not None and interval > 0 and self._state.progress.global_step % interval == 0

    def _trainer_state(self) -> dict[str, Any]:
        state, progress = self._state, self._state.progress
        return {
            "skipped_steps": progress.skipped_steps,
            "samples_consumed": progress.samples_consumed,
            "loss_scaler": None if state.loss_scaler is None else state.loss_scaler.state_dict(),
            "data": state.data_position.state_dict(),
            "seed": self._settings.seed,
            "precision": self._settings.precision.value,
        }

    def load_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Continue from a checkpoint: ``path`` is one checkpoint directory or a checkpoint root
        (its latest complete checkpoint is taken). Parameters, Adam state, step counts, loss
        scale, random streams and data position are restored; the world size may differ."""
        return self._load(self._state.checkpointer.locate(Path(path)))

    def resume(self) -> Path | None:
        """What ``initialize`` does with ``checkpoint.resume``: auto loads the latest complete
        checkpoint in ``checkpoint.dir`` if there is one, a path loads that, never nothing."""
        checkpointer = self._state.checkpointer
        settings = checkpointer.settings
        if settings.resume == "never":
            return None
        if settings.resume != "auto":
            return self.load_checkpoint(settings.resume)
        if settings.dir is None:
            return None
        found = checkpointer.latest(settings.dir)
        return None if found is None else self._load(found)

    def _load(self, checkpoint: Checkpoint) -> Path:
        self._window.refuse_inside("load_checkpoint")
        state, progress = self._state, self._state.progress
        manifest = state.checkpointer.load(checkpoint, log=self._log)
        progress.torn = None  # every parameter and moment comes from the checkpoint again
        try:
            progress.global_step = int(manifest["global_step"])
            progress.skipped_steps = int(manifest["skipped_steps"])
            progress.samples_consumed = int(manifest["samples_consumed"])
            scaler = manifest["loss_scaler"]
            data = manifest["data"]
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{checkpoint.path}: manifest lacks {err}") from err
        if state.loss_scaler is not None and scaler is not None:
            state.loss_scaler.load_state_dict(scaler)
        state.data_position.load_state_dict(data)
        self._moved()
        progress.resumed_from = checkpoint.path
        self._log(f"resumed from {checkpoint.path} (update {progress.global_step})")
        return checkpoint.path
