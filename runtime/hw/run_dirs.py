"""Where a store's files live, and how the directory goes away however the run ends: the
activation files (``ActivationFileStore``) and the NVMe tier's optimizer state
(runtime/chunks/nvme_state.py, ``protrain-optim-`` instead of ``protrain-act-``).

Each ``ActivationFileStore`` writes into its own run directory ``root / protrain-act-{host}-{pid}-
rank{rank}``; a second store of the same process and rank (a teacher's beside a student's: two
engines alive at once) gets ``-2``, then ``-3``. The store removes its directory when it closes,
is garbage collected or the interpreter exits; after a crash, the next store created on the same
root removes it (``remove_stale``).

A registry of the directories this process's open stores hold tells which names are in use: a
directory named for this host and pid that is not listed was left by an earlier process with the
same pid (a restarted container reuses pids), so it is stale even though its pid is alive.
Directories of other hosts (a shared root) and of live processes are never touched.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import socket
import threading
from pathlib import Path

from protrain.runtime.hw.ssd_io import SsdIoError

RUN_DIR_PREFIX = "protrain-act-"

# Run directories of the stores open in this process. Reentrant: a store's finalizer takes the
# lock and garbage collection may run it on a thread that already holds it.
_LIVE_RUN_DIRS: set[Path] = set()
_LIVE_RUN_DIRS_LOCK = threading.RLock()


def create_run_dir(root: Path, rank: int, *, prefix: str = RUN_DIR_PREFIX, what: str = "activation files") -> Path:
    """Make ``root`` (if needed), clear crashed runs' directories, create this store's own: the
    first name for this host, pid and rank that no open store of this process holds.
    ``prefix``: the kind of store (activation files; optimizer state, ``protrain-optim-``)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SsdIoError(
            err.errno,
            f"cannot use {root} for {what}: {err.strerror}; set memory.ssd.path to a directory",
        ) from err
    if not os.access(root, os.W_OK | os.X_OK):
        raise SsdIoError(f"{root} is not a writable directory; set memory.ssd.path to one this process can write")
    remove_stale(root, prefix=prefix)
    stem = root.resolve() / f"{prefix}{socket.gethostname()}-{os.getpid()}-rank{rank}"
    with _LIVE_RUN_DIRS_LOCK:
        run_dir = _unused_run_dir(stem)
        # Named for our pid but held by no store of ours: left by an earlier process with this
        # pid (remove_stale cleared it unless it is new) or by a store of ours whose removal failed.
        shutil.rmtree(run_dir, ignore_errors=True)
        try:
            run_dir.mkdir()
        except OSError as err:
            raise SsdIoError(err.errno, f"cannot create the directory {run_dir} for {what}: {err.strerror}") from err
        _LIVE_RUN_DIRS.add(run_dir)
    return run_dir


def remove_run_dir(run_dir: Path) -> None:
    """Remove ``run_dir`` and everything in it, and free its name for another store of this
    process (even when the removal fails: the next store of that name clears it first)."""
    try:
        shutil.rmtree(run_dir)
    except FileNotFoundError:
        pass
    except OSError as err:
        raise SsdIoError(err.errno, f"cannot remove the directory {run_dir}: {err.strerror}") from err
    finally:
        with _LIVE_RUN_DIRS_LOCK:
            _LIVE_RUN_DIRS.discard(run_dir)


def remove_stale(root: str | os.PathLike[str], *, prefix: str = RUN_DIR_PREFIX) -> list[Path]:
    """Remove this host's run directories under ``root`` that no live store owns: those of
    processes that are gone (a crashed or killed run), and those named for this process that
    none of its open stores holds (left by an earlier process with the same pid). Other live
    processes', this process's open stores' and other hosts' directories are left alone."""
    pattern = re.compile(re.escape(f"{prefix}{socket.gethostname()}-") + r"(\d+)-rank\d+(-\d+)?")
    try:
        entries = sorted(Path(root).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed: list[Path] = []
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or entry.is_symlink() or not entry.is_dir():
            continue
        pid = int(match.group(1))
        if pid == os.getpid():
            with _LIVE_RUN_DIRS_LOCK:  # no store of ours can claim the name while it goes
                if _held_by_this_process(entry):
                    continue
                shutil.rmtree(entry, ignore_errors=True)
        elif _pid_alive(pid):
            continue
        else:
            shutil.rmtree(entry, ignore_errors=True)  # another rank of this host may be removing it too
        if not entry.exists():
            removed.append(entry)
    return removed


def _unused_run_dir(stem: Path) -> Path:
    """``stem``, else ``stem-2``, ``stem-3``, ...: the first that no open store of this process
    holds (lock held), as run folders are numbered for a second engine of the same process."""
    for attempt in itertools.count(1):
        candidate = stem if attempt == 1 else stem.with_name(f"{stem.name}-{attempt}")
        if candidate not in _LIVE_RUN_DIRS:
            return candidate
    raise AssertionError("unreachable")


def _held_by_this_process(run_dir: Path) -> bool:
    """An open store of this process holds ``run_dir`` (lock held; the registry keeps resolved
    paths, ``run_dir`` may be spelled through a symlinked root)."""
    return run_dir.parent.resolve() / run_dir.name in _LIVE_RUN_DIRS


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True
