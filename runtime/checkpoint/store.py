"""Checkpoint directories on disk: names, atomic publication, the ``latest`` pointer, pruning,
and the checks that tell a complete checkpoint from a broken one. No torch here.

A checkpoint root (``checkpoint.dir``) holds::

    step-00000050/          a complete checkpoint (torch.distributed.checkpoint files + manifest)
    step-00000100/
    latest                  the name of the newest complete checkpoint, one line
    .tmp-step-00000150/     a save in progress (or one a crash interrupted)

A save writes everything into ``.tmp-step-N``; the manifest (``protrain.json``, listing every
file with its size) is written last, then the directory is renamed to ``step-N`` and ``latest``
is replaced (write a temporary, ``os.replace``), each step flushed to disk. A crash at any point
therefore leaves the previous checkpoint and pointer intact: a ``.tmp-*`` directory is never
read, and is removed by the next save. Saving again at a step that already has a checkpoint
moves the old one aside (``.tmp-old-step-N``) before the new one is renamed in; a crash between
the two renames is repaired by ``recover`` (the complete one of the two takes the name back).
A checkpoint is complete when its manifest parses and every file it lists has the listed size;
it is intact when every file's CRC-32 (recorded at save, each rank summing the files it wrote)
matches (checked at load, the files spread over the ranks).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protrain.runtime.hw.durable import fsync_path

MANIFEST = "protrain.json"
LATEST = "latest"
FORMAT = "protrain-checkpoint"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TEMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and what is wrong."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def temp_dir(root: Path, step: int) -> Path:
    return root / f"{_TEMP_PREFIX}{checkpoint_name(step)}"


def write_file_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary and a rename (never half a file)."""
    partial = path.with_name(f"{_TEMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        with open(partial, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    fsync_path(path.parent)


def recover(root: Path) -> list[Path]:
    """After a crash between publish's two renames ``step-N`` is missing while a complete copy
    sits in a temporary name: give it the name back (the new save first, else the old one)."""
    restored: list[Path] = []
    if not root.is_dir():
        return restored
    for prefix in (_TEMP_PREFIX, f"{_TEMP_PREFIX}old-"):
        for entry in sorted(root.iterdir()):
            name = entry.name[len(prefix) :] if entry.name.startswith(prefix) else ""
            if not _STEP_DIR.match(name) or (root / name).exists() or not entry.is_dir():
                continue
            try:
                read_checkpoint(entry)
            except CheckpointError:
                continue
            os.replace(entry, root / name)
            restored.append(root / name)
    if restored:
        fsync_path(root)
    return restored


def remove_stale_temps(root: Path) -> list[Path]:
    """Delete saves a crash or kill interrupted (only one job writes into a root), after
    ``recover`` has put back a complete checkpoint that had lost its name."""
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    recover(root)
    for entry in root.iterdir():
        if entry.name.startswith(_TEMP_PREFIX):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def list_files(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` (relative path -> size), the manifest excluded."""
    return {
        str(path.relative_to(directory)): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }


CRC_BLOCK = 4 << 20


def file_crc32(path: Path) -> int:
    """CRC-32 of a file's bytes, read in blocks (zlib: about a GB/s per core) into one reused
    buffer (a fresh ``bytes`` per read held two blocks at a time)."""
    crc = 0
    block = bytearray(max(1, min(CRC_BLOCK, path.stat().st_size)))
    view = memoryview(block)
    with open(path, "rb") as handle:
        while count := handle.readinto(block):
            crc = zlib.crc32(view[:count], crc)
    return crc


def corrupt_files(checkpoint: Checkpoint, names: list[str]) -> list[str]:
    """Which of ``names`` no longer have the CRC-32 the manifest recorded (a checkpoint saved
    without checksums passes)."""
    recorded = checkpoint.manifest.get("checksums", {})
    return [name for name in names if name in recorded and file_crc32(checkpoint.path / name) != recorded[name]]


def write_manifest(directory: Path, content: dict[str, Any]) -> None:
    """The manifest goes last: it lists the files already written, with their sizes, and its
    presence marks the directory complete."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, **content, "files": list_files(directory)}
    write_file_durably(directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def publish(temp: Path, final: Path) -> None:
    """Rename a finished save into place and point ``latest`` at it."""
    old = final.with_name(f"{_TEMP_PREFIX}old-{final.name}")
    if final.exists():
        # Saved again at the same step (a stop right after a periodic save, a restarted job
        # re-reaching it): the new one wins, the old one is moved aside first, never deleted
        # before the new one has its name.
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(temp, final)
    fsync_path(final.parent)
    write_file_durably(final.parent / LATEST, final.name + "\n")
    shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    path: Path
    step: int
    manifest: dict[str, Any]


def read_checkpoint(path: Path) -> Checkpoint:
    """Read and check one checkpoint directory; ``CheckpointError`` says what is wrong."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    if not path.is_dir():
        raise CheckpointError(f"{path}: is not a directory (a checkpoint is a directory)")
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise CheckpointError(f"{path}: incomplete checkpoint: {MANIFEST} is missing (the save did not finish)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{manifest_path}: unreadable manifest: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: not a ProTrain checkpoint manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{manifest_path}: checkpoint format version {manifest.get('version')!r}; this ProTrain "
            f"reads version {FORMAT_VERSION}"
        )
    for name, size in sorted(manifest.get("files", {}).items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: corrupt checkpoint: {name} is missing")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(f"{path}: corrupt checkpoint: {name} is {actual} bytes, the manifest says {size}")
    step = manifest.get("global_step")
    if not isinstance(step, int):
        raise CheckpointError(f"{manifest_path}: global_step missing or not an integer")
    return Checkpoint(path=path, step=step, manifest=manifest)


def complete_checkpoints(root: Path) -> list[Checkpoint]:
    """The complete checkpoints in ``root``, oldest first (broken ones are skipped)."""
    found: list[Checkpoint] = []
    if not root.is_dir():
        return found
    for entry in root.iterdir():
        if _STEP_DIR.match(entry.name) and entry.is_dir():
            try:
                found.append(read_checkpoint(entry))
            except CheckpointError:
                continue
    return sorted(found, key=lambda checkpoint: checkpoint.step)


def latest_checkpoint(root: Path) -> Checkpoint | None:
    """What ``resume: auto`` loads: the checkpoint ``latest`` names if it is complete, else the
    newest complete one (a kill between the rename and the pointer update), else None."""
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text(encoding="utf-8").strip()
        if _STEP_DIR.match(name):
            try:
                return read_checkpoint(root / name)
            except CheckpointError:
                pass
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None


def resolve_resume_path(path: Path) -> Checkpoint:
    """A path given as ``checkpoint.resume`` or to ``load_checkpoint``: one checkpoint directory,
    or a root whose latest complete checkpoint is taken."""
    if (path / MANIFEST).exists() or _STEP_DIR.match(path.name):
        return read_checkpoint(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint or checkpoint directory")
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(f"{path}: holds no complete checkpoint (step-NNNNNNNN directories)")
    return found


def prune(root: Path, keep_last: int) -> list[Path]:
    """Remove all but the newest ``keep_last`` complete checkpoints; never the one ``latest``
    names. Incomplete ``step-*`` directories are left for a person to look at."""
    complete = complete_checkpoints(root)
    pointer = root / LATEST
    protected = pointer.read_text(encoding="utf-8").strip() if pointer.is_file() else ""
    removed = []
    for checkpoint in complete[: max(0, len(complete) - keep_last)]:
        if checkpoint.path.name == protected:
            continue
        shutil.rmtree(checkpoint.path, ignore_errors=True)
        removed.append(checkpoint.path)
    return removed
