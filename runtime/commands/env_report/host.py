"""The host: CPU cores; RAM and what ``memory.host_budget: auto`` counts on (``runtime.hw.host_capacity``,
the function the budget reads); /dev/shm; and the disks: the folder under ``--ssd-path`` (free space,
O_DIRECT, rates measured as the SSD activation tier does I/O) and the profile cache."""

from __future__ import annotations

import os
import shutil
from datetime import datetime
from pathlib import Path

import psutil

from protrain.runtime.commands.env_report.rows import Row, Status, format_bytes, format_rate, note_if, run_probe
from protrain.runtime.hw.host_capacity import free_host_bytes

SMALL_SHM_BYTES = 1 << 30  # containers default to 64 MiB; NCCL and DataLoader workers then die with "Bus error"
PROBE_PIECE_BYTES = 8 << 20  # bytes per write and read of the disk probe, as the store writes pieces


def cpu_rows() -> list[Row]:
    logical, physical = os.cpu_count(), psutil.cpu_count(logical=False)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    text = f"{logical} logical, {physical or '?'} physical; this process may use {usable}"
    counts = {"logical": logical, "physical": physical, "usable": usable}
    return [Row("cores", text, counts, note_if(usable != logical))]


def memory_rows(root: Path = Path("/")) -> list[Row]:
    memory = psutil.virtual_memory()
    text = f"{format_bytes(memory.total)} total, {format_bytes(memory.available)} available"
    rows = [Row("RAM", text, {"total": memory.total, "available": memory.available})]
    return rows + run_probe("free for the job", lambda: [free_row(root)]) + run_probe("/dev/shm", shm_rows)


def free_row(root: Path) -> Row:
    """What the auto host budget divides among this node's ranks: the tightest of available RAM, a
    cgroup's headroom (where the OOM killer acts) and Slurm's allocation."""
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "")
    free, source = free_host_bytes(root=root, ranks_on_host=max(1, int(ranks)) if ranks.isdigit() else 1)
    return Row("free for the job", f"{format_bytes(free)} (the tightest: {source.name}; {source.detail})", free)


def shm_rows() -> list[Row]:
    usage = shutil.disk_usage("/dev/shm")
    small = usage.total < SMALL_SHM_BYTES
    hint = "; small for NCCL and DataLoader workers (docker run --shm-size)" if small else ""
    return [Row("/dev/shm", f"{format_bytes(usage.total)} total{hint}", usage.total, note_if(small))]


def ssd_rows(path: Path | None, probe_bytes: int, *, spec_path: str | None = None) -> list[Row]:
    if path is None:
        hint = f" (the spec's memory.ssd.path is {spec_path})" if spec_path else ""
        return [Row("SSD path", f"not measured: give --ssd-path DIR{hint}", status=Status.NOTE)]
    folder = path.expanduser()
    if not folder.is_dir():
        reason = "does not exist" if not folder.exists() else "is not a directory"
        return [Row("SSD path", f"{folder} {reason}", status=Status.FAILED)]
    return [folder_row("SSD path", folder)] + run_probe("disk rates", lambda: _rate_rows(folder, probe_bytes))


def folder_row(name: str, folder: Path, what: str = "") -> Row:
    """The folder, ``what`` is in it, and its filesystem's free space."""
    usage, path = shutil.disk_usage(folder), folder.resolve()
    text = f"{path}{what}; {format_bytes(usage.free)} free of {format_bytes(usage.total)}"
    return Row(name, text, {"path": str(path), "free": usage.free, "total": usage.total})


def _rate_rows(folder: Path, probe_bytes: int) -> list[Row]:
    from protrain.runtime.hw.ssd_io import IO_MODE_DIRECT, measure_disk_rates, padded  # imports torch

    piece = min(PROBE_PIECE_BYTES, padded(probe_bytes))
    write_bps, read_bps, mode = measure_disk_rates(folder, nbytes=probe_bytes, chunk_bytes=piece)
    direct, size = mode == IO_MODE_DIRECT, format_bytes(probe_bytes)
    return [
        Row("O_DIRECT", "yes" if direct else f"no: the SSD tier uses {mode}", direct, note_if(not direct)),
        Row("write rate", f"{format_rate(write_bps)} ({size}, fsync'd)", write_bps),
        Row("read rate", f"{format_rate(read_bps)} ({size}, page cache dropped)", read_bps),
    ]


def cache_rows(cache_dir: Path) -> list[Row]:
    """The folder with its profiles' count and newest date (an old profile may describe another machine)."""
    folder = cache_dir.expanduser()
    if not folder.is_dir():
        state = "is not a directory" if folder.exists() else "empty (not created yet)"
        return [Row("profile cache", f"{folder}: {state}", status=Status.FAILED if folder.exists() else Status.OK)]
    dates = sorted(path.stat().st_mtime for path in folder.glob("*.json"))
    newest = f", newest {datetime.fromtimestamp(dates[-1]):%Y-%m-%d %H:%M}" if dates else ""
    return [folder_row("profile cache", folder, f": {len(dates)} profiles{newest}")]
