"""Saving and loading a whole training state: every rank calls these together.

A checkpoint is one ``torch.distributed.checkpoint`` save (parameters and Adam state in parameter
space, see ``params``; module buffers; each rank's random generators) plus a manifest written by
rank 0 with what is not a tensor: global step, skipped updates, loss scaler, data position, and
the parameter names and shapes the loader checks against the model. Publication is atomic
(``store``): a save is written into a temporary directory and renamed, ``latest`` updated last.

The collectives run on a process group of their own (gloo), created the first time, so that an
asynchronous save, whose collectives run on a background thread, never interleaves with the
training collectives on the default group. ``async_save`` copies the state to host memory on the
calling thread (the next update may then change the live state) and writes in the background;
the next save, a load, or ``close`` waits for it and raises its error, if any.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from protrain.runtime.checkpoint import rng
from protrain.runtime.checkpoint.params import ParameterSpace, expected_entries
from protrain.runtime.checkpoint.staging import DeviceStaging, StagingLoadPlanner, StagingSavePlanner
from protrain.runtime.checkpoint.store import (
    Checkpoint,
    CheckpointError,
    checkpoint_name,
    corrupt_files,
    file_crc32,
    latest_checkpoint,
    prune,
    publish,
    recover,
    remove_stale_temps,
    resolve_resume_path,
    temp_dir,
    write_manifest,
)
from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.config.job import CheckpointSettings
from protrain.runtime.hw import device_wall
from protrain.runtime.hw.distributed import DistContext, broadcast_object

BUFFER = "buffer."
T = TypeVar("T")


class ChunkHolder(Protocol):
    """Where the checkpointer finds the chunk manager in force (the engine's training state)."""

    chunks: ChunkManager


class Checkpointer:
    def __init__(
        self,
        *,
        holder: ChunkHolder,
        module: nn.Module,
        dist_ctx: DistContext,
        settings: CheckpointSettings,
        seed: int,
    ) -> None:
        self._holder = holder
        self.module = module
        self.dist_ctx = dist_ctx
        self.settings = settings
        self.seed = seed
        self._group: dist.ProcessGroup | None = None
        self._space: ParameterSpace | None = None
        self._space_of: ChunkManager | None = None
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None
        self._pending_path: Path | None = None

    @property
    def chunks(self) -> ChunkManager:
        """The chunk manager in force (read at each use: a plan switch replaces it)."""
        return self._holder.chunks

    # ------------------------------------------------------------------ plumbing

    @property
    def distributed(self) -> bool:
        return self.dist_ctx.world_size > 1

    def _checkpoint_group(self) -> dist.ProcessGroup | None:
        if self.distributed and self._group is None:
            # A collective: every rank reaches its first save or load at the same point.
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _parameter_space(self) -> ParameterSpace:
        if self._space is None or self._space_of is not self.chunks:
            self._space = ParameterSpace(self.chunks, self._checkpoint_group())
            self._space_of = self.chunks
        return self._space

    @contextlib.contextmanager
    def _dcp_call(self) -> Iterator[None]:
        """DCP warns on every single-process call that it assumes one process (so do we), and
        whenever it touches a ShardedTensor that the type is deprecated (see ``params``). What
        it allocates is host memory: tensors staged to and from the files."""
        with warnings.catch_warnings(), device_wall.host_allocations():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
            yield

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self._checkpoint_group())

    def _on_main(self, action: Callable[[], T], what: str) -> T:
        """Run ``action`` on rank 0 only (the file-system work of a shared directory) and give
        every rank its result, or its error as a CheckpointError: a failure there never leaves
        the other ranks waiting in a collective, and all ranks act on one answer."""
        outcome: tuple[bool, Any] = (True, None)
        if self.dist_ctx.is_main:
            try:
                outcome = (True, action())
            except CheckpointError as err:
                outcome = (False, str(err))
            except Exception as err:
                outcome = (False, f"{what} failed on rank 0: {type(err).__name__}: {err}")
        shared = broadcast_object(outcome, self.dist_ctx, self._checkpoint_group())
        assert isinstance(shared, tuple)  # rank 0's outcome
        ok, value = shared
        if not ok:
            raise CheckpointError(value)
        return value  # type: ignore[no-any-return]

    def _buffers(self) -> dict[str, torch.Tensor]:
        """Persistent module buffers by name (parameters live in chunks)."""
        names = {name for name, _ in self.module.named_parameters(remove_duplicate=False)}
        return {
            name: tensor
            for name, tensor in self.module.state_dict(keep_vars=True).items()
            if name not in names and isinstance(tensor, torch.Tensor)
        }

    # ------------------------------------------------------------------ save

    def save(self, root: Path, *, step: int, trainer_state: dict[str, Any]) -> Path:
        """Write the checkpoint of update ``step`` under ``root``; returns its final path."""
        self.wait()
        self.chunks.drain()  # updates still running on the host worker (two-phase step) land first
        final = root / checkpoint_name(step)
        temp = temp_dir(root, step)

        def prepare() -> None:
            root.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(root)
            temp.mkdir()

        self._on_main(prepare, f"preparing {temp}")
        space = self._parameter_space()
        with device_wall.host_allocations():  # host copies of device state, for the writer
            state = space.for_save(copy=self.settings.async_save)
            state_dict = state.state_dict
            for name, tensor in self._buffers().items():
                state_dict[BUFFER + name] = tensor.detach().to("cpu", copy=True)
            state_dict.update(rng.capture(self.dist_ctx.rank))
        rule = self.chunks.optimizer_rule
        manifest = {
            **trainer_state,
            "global_step": step,
            "world_size": self.dist_ctx.world_size,
            "optimizer": {"type": rule.name, "state": list(rule.state_names)},
            "params": {
                name: {"shape": list(shape), "trainable": trainable}
                for name, (shape, trainable) in expected_entries(self.chunks.layout).items()
            },
        }

        def write() -> None:
            self._write(state_dict, state.staging, temp=temp, final=final, root=root, manifest=manifest)

        if not self.settings.async_save:
            write()
            return final
        self._pending_path = final
        self._pending_error = None

        def background() -> None:
            try:
                write()
            except BaseException as err:  # re-raised on the training thread by wait()
                self._pending_error = err

        self._pending = threading.Thread(target=background, name="protrain-checkpoint", daemon=True)
        self._pending.start()
        # A script that ends without close() still finishes the save before the interpreter goes.
        atexit.register(self._finish_at_exit)
        return final

    def _write(
        self,
        state_dict: dict[str, Any],
        staging: DeviceStaging | None,
        *,
        temp: Path,
        final: Path,
        root: Path,
        manifest: dict[str, Any],
    ) -> None:
        try:
            # One item at a time (per_thread_copy_ahead=0): device pieces share one host buffer.
            writer = dcp.FileSystemWriter(
                temp, single_file_per_rank=True, sync_files=True, thread_count=1, per_thread_copy_ahead=0
            )
            with self._dcp_call():
                dcp.save(
                    state_dict,
                    storage_writer=writer,
                    planner=StagingSavePlanner(staging),
                    process_group=self._checkpoint_group(),
                    no_dist=not self.distributed,
                )

            # Each rank sums the files it wrote (just written: read back from the page cache).
            mine = {path.name: file_crc32(path) for path in sorted(temp.glob(f"__{self.dist_ctx.rank}_*.distcp"))}
            checksums = self._gathered(mine)

            def finish() -> None:
                try:
                    metadata = temp / ".metadata"
                    if metadata.exists():
                        checksums[metadata.name] = file_crc32(metadata)
                    write_manifest(temp, {**manifest, "checksums": checksums})
                    publish(temp, final)
                except BaseException:
                    shutil.rmtree(temp, ignore_errors=True)
                    raise
                prune(root, self.settings.keep_last)

            self._on_main(finish, f"publishing {final}")
        except Exception as err:
            # DCP raises on every rank alike, _on_main too: every rank ends up here.
            if self.dist_ctx.is_main:
                shutil.rmtree(temp, ignore_errors=True)
            raise CheckpointError(
                f"saving checkpoint {final} failed: {err}; the previous checkpoint in {root} is intact"
            ) from err

    def _gathered(self, mine: dict[str, int]) -> dict[str, int]:
        """Every rank's entries, merged (a collective on the checkpoint group)."""
        if not self.distributed:
            return dict(mine)
        parts: list[dict[str, int] | None] = [None] * self.dist_ctx.world_size
        dist.all_gather_object(parts, mine, group=self._checkpoint_group())
        return {name: crc for part in parts if part for name, crc in part.items()}

    def _check_intact(self, checkpoint: Checkpoint) -> None:
        """Every file's CRC-32 against the manifest, the files spread over the ranks; every rank
        learns of a mismatch anywhere."""
        names = sorted(checkpoint.manifest.get("checksums", {}))
        share = names[self.dist_ctx.rank :: self.dist_ctx.world_size]
        bad = sorted(set(self._gathered({name: 1 for name in corrupt_files(checkpoint, share)})))
        if bad:
            raise CheckpointError(
                f"{checkpoint.path}: corrupt checkpoint: {', '.join(bad)} changed since it was saved (CRC-32 mismatch)"
            )

    def _finish_at_exit(self) -> None:
        try:
            self.wait()
        except BaseException as err:  # noqa: BLE001 - at exit, a message is all that can be given
            print(f"protrain: the checkpoint written at exit failed: {err}", file=sys.stderr)

    def wait(self) -> None:
        """Wait for an asynchronous save; raise its error here, on the training thread."""
        if self._pending is None:
            return
        atexit.unregister(self._finish_at_exit)
        self._pending.join()
        self._pending = None
        error, self._pending_error = self._pending_error, None
        if error is not None:
            raise error

    # ------------------------------------------------------------------ load

    def locate(self, path: Path) -> Checkpoint:
        """The checkpoint ``path`` names, as rank 0 reads it (every rank loads the same one)."""

        def resolve() -> Checkpoint:
            if path.is_dir() and not (path / "protrain.json").exists():
                recover(path)
            return resolve_resume_path(path)

        return self._on_main(resolve, f"reading {path}")

    def latest(self, root: Path) -> Checkpoint | None:
        """``resume: auto``: the latest complete checkpoint under ``root``, as rank 0 sees it."""

        def find() -> Checkpoint | None:
            recover(root)
            return latest_checkpoint(root)

        return self._on_main(find, f"reading {root}")

    def load(self, checkpoint: Checkpoint, *, log: Callable[[str], None]) -> dict[str, Any]:
        """Load ``checkpoint`` into the live state; returns its manifest."""
        self.wait()
        self.chunks.drain()  # nothing on the host worker may write the state loaded into
        self._check_params(checkpoint)
        self._check_optimizer(checkpoint)
        self._check_intact(checkpoint)
        space = self._parameter_space()
        buffers = self._buffers()
        with device_wall.host_allocations():  # host staging of device state, for the reader
            state = space.for_load()
            staged_buffers = {name: torch.empty_like(t, device="cpu") for name, t in buffers.items()}
        state_dict = state.state_dict
        state_dict.update({BUFFER + name: t for name, t in staged_buffers.items()})
        reader = dcp.FileSystemReader(checkpoint.path)

        def read_keys() -> set[str]:
            try:
                return set(reader.read_metadata().state_dict_metadata)
            except Exception as err:
                raise CheckpointError(f"{checkpoint.path}: corrupt checkpoint metadata: {err}") from err

        saved_keys = self._on_main(read_keys, f"reading {checkpoint.path}")
        same_world = checkpoint.manifest.get("world_size") == self.dist_ctx.world_size
        with device_wall.host_allocations():
            rng_targets = rng.load_targets(self.dist_ctx.rank, saved_keys) if same_world else {}
        state_dict.update(rng_targets)
        missing = sorted(key for key in state_dict if key not in saved_keys)
        if missing:
            raise CheckpointError(
                f"{checkpoint.path}: does not hold {', '.join(missing[:5])}"
                + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            )
        try:
            with self._dcp_call():
                dcp.load(
                    state_dict,
                    storage_reader=reader,
                    planner=StagingLoadPlanner(state.staging),
                    process_group=self._checkpoint_group(),
                    no_dist=not self.distributed,
                )
        except Exception as err:
            raise CheckpointError(f"{checkpoint.path}: corrupt checkpoint, reading it failed: {err}") from err
        state.finish_load()
        with torch.no_grad():
            for name, tensor in buffers.items():
                tensor.copy_(staged_buffers[name])
        self.chunks.refresh_full_copies(frozen_too=True)
        if same_world:
            rng.restore(self.dist_ctx.rank, {key: state_dict[key] for key in rng_targets})
        else:
            rng.reseed(self.seed, checkpoint.step, self.dist_ctx.rank)
            log(
                f"resumed on {self.dist_ctx.world_size} rank(s) from a checkpoint of "
                f"{checkpoint.manifest.get('world_size')}: random streams reseeded (dropout masks "
                "differ from the uninterrupted run)"
            )
        self._barrier()
        return checkpoint.manifest

    def _check_params(self, checkpoint: Checkpoint) -> None:
        saved = checkpoint.manifest.get("params")
        if not isinstance(saved, dict):
            raise CheckpointError(f"{checkpoint.path}: manifest lists no parameters")
        expected = expected_entries(self.chunks.layout)
        problems = [f"{name} is not in the model" for name in sorted(set(saved) - set(expected))]
        problems += [f"{name} is missing" for name in sorted(set(expected) - set(saved))]
        for name in sorted(set(saved) & set(expected)):
            shape, trainable = expected[name]
            if tuple(saved[name].get("shape", ())) != shape:
                problems.append(f"{name} has shape {tuple(saved[name].get('shape', ()))}, the model {shape}")
            elif trainable and not saved[name].get("trainable", False):
                problems.append(f"{name} was frozen when saved (no optimizer state) but is trainable now")
        if problems:
            shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
            raise CheckpointError(f"{checkpoint.path}: does not match this model: {shown}")

    def _check_optimizer(self, checkpoint: Checkpoint) -> None:
        """The optimizer state saved is the state this job's optimizer continues from: the same
        rule (a checkpoint from before the manifest said so is AdamW's) and the same state
        tensors (SGD keeps its momentum buffer only with momentum)."""
        saved = checkpoint.manifest.get("optimizer") or {"type": "adamw", "state": ["exp_avg", "exp_avg_sq"]}
        rule = self.chunks.optimizer_rule
        if saved.get("type") != rule.name:
            raise CheckpointError(
                f"{checkpoint.path}: was saved by optimizer.type {saved.get('type')!r}, this job runs "
                f"{rule.name!r}; its optimizer state cannot continue another rule. Resume with "
                f"optimizer.type: {saved.get('type')}, or to switch, resume it so and engine.export() "
                f"the weights, then start {rule.name} from them (docs/checkpoints.md)"
            )
        if list(saved.get("state", [])) != list(rule.state_names):
            have = ", ".join(saved.get("state", [])) or "none"
            want = ", ".join(rule.state_names) or "none"
            raise CheckpointError(
                f"{checkpoint.path}: holds the optimizer state {have}, this job's {rule.name} needs {want} "
                "(sgd keeps a momentum buffer only when optimizer.momentum > 0): resume with the "
                "momentum it was saved with"
            )

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._group is not None and dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None
