"""Disks and caches for the report: the filesystem under ``--ssd-path`` (its type, free space,
whether it takes O_DIRECT, and write and read rates measured the way the SSD activation store
does I/O: ``measure_disk_rates``), and the profile cache entries under ``profiler.cache_dir``
with their age (a stale cached profile is a common cause of a plan that misses its prediction).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from protrain.runtime.commands.env_report.rows import Row, Status, format_age, format_bytes, format_rate, run_probe

PROBE_PIECE_BYTES = 8 << 20
"""Bytes per write and read of the disk probe (as the store's files are written: whole pieces)."""
ALIGN = 4096
"""O_DIRECT alignment of lengths (``runtime.hw.ssd_io.BLOCK_BYTES``)."""
MAX_CACHE_ROWS = 20
"""Cache entries shown, newest first; the JSON output lists them all."""


def ssd_rows(path: Path | None, probe_bytes: int, *, spec_path: str | None = None) -> list[Row]:
    if path is None:
        hint = f" (the spec's memory.ssd.path is {spec_path})" if spec_path else ""
        return [Row("SSD path", f"not measured: give --ssd-path DIR{hint}", status=Status.NOTE)]
    folder = path.expanduser()
    if not folder.is_dir():
        reason = "does not exist" if not folder.exists() else "is not a directory"
        return [Row("SSD path", f"{folder} {reason}", status=Status.FAILED)]
    rows = [Row("SSD path", str(folder.resolve()))]
    rows += run_probe("filesystem", lambda: [filesystem_row(folder)])
    rows += run_probe("disk rates", lambda: _rate_rows(folder, probe_bytes))
    return rows


def filesystem_row(folder: Path, mounts: Path = Path("/proc/mounts")) -> Row:
    """The mount holding ``folder`` (the longest mount point above it) and its free space."""
    usage = shutil.disk_usage(folder)
    resolved = folder.resolve()
    best: tuple[str, str, str] | None = None
    if mounts.exists():
        for line in mounts.read_text().splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            device, point, kind = fields[0], fields[1].replace("\\040", " "), fields[2]
            if (resolved == Path(point) or Path(point) in resolved.parents) and (
                best is None or len(point) > len(best[1])
            ):
                best = (device, point, kind)
    mount = f"{best[2]} on {best[1]} ({best[0]})" if best else "mount unknown"
    text = f"{mount}; {format_bytes(usage.free)} free of {format_bytes(usage.total)}"
    value = {"free": usage.free, "total": usage.total, "type": best[2] if best else None}
    return Row("filesystem", text, value)


def _rate_rows(folder: Path, probe_bytes: int) -> list[Row]:
    from protrain.runtime.hw.ssd_io import IO_MODE_DIRECT, measure_disk_rates  # imports torch

    piece = min(PROBE_PIECE_BYTES, -(-probe_bytes // ALIGN) * ALIGN)
    write_bps, read_bps, mode = measure_disk_rates(folder, nbytes=probe_bytes, chunk_bytes=piece)
    direct = mode == IO_MODE_DIRECT
    size = format_bytes(probe_bytes)
    return [
        Row(
            "O_DIRECT",
            "yes" if direct else f"no: the filesystem refuses it; the SSD tier uses {mode}",
            direct,
            Status.OK if direct else Status.NOTE,
        ),
        Row("write rate", f"{format_rate(write_bps)} ({size}, fsync'd)", write_bps),
        Row("read rate", f"{format_rate(read_bps)} ({size}, page cache dropped)", read_bps),
    ]


def cache_rows(cache_dir: Path, *, now: float | None = None) -> list[Row]:
    """One row per cached profile, newest first (at most ``MAX_CACHE_ROWS``), after a row for
    the folder itself."""
    folder = cache_dir.expanduser()
    if not folder.exists():
        return [Row("profile cache", f"{folder}: empty (not created yet)", [])]
    if not folder.is_dir():
        return [Row("profile cache", f"{folder} is not a directory", status=Status.FAILED)]
    now = time.time() if now is None else now
    entries = sorted(folder.glob("*.json"), key=lambda entry: entry.stat().st_mtime, reverse=True)
    leftovers = list(folder.glob("*.tmp"))
    described = [describe_entry(entry, now) for entry in entries]
    head = f"{folder}: {len(entries)} entries"
    if leftovers:
        head += f", {len(leftovers)} unfinished *.tmp writes (safe to remove)"
    rows = [Row("profile cache", head, [value for _, value in described])]
    for text, value in described[:MAX_CACHE_ROWS]:
        rows.append(Row(value["file"], text, status=Status.NOTE if value.get("problem") else Status.OK))
    if len(described) > MAX_CACHE_ROWS:
        rows.append(Row("...", f"{len(described) - MAX_CACHE_ROWS} older entries (all are in --json)"))
    return rows


def describe_entry(entry: Path, now: float) -> tuple[str, dict[str, Any]]:
    """(text, JSON value) of one cache file: its age and size and what it describes."""
    stat = entry.stat()
    age = now - stat.st_mtime
    value: dict[str, Any] = {"file": entry.name, "age_s": round(age, 1), "bytes": stat.st_size}
    try:
        body = json.loads(entry.read_text())
        summary = _summary(entry.name, body)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        summary = f"unreadable ({type(err).__name__}): the next launch measures again"
        value["problem"] = summary
    value["summary"] = summary
    return f"{format_age(age)} old, {format_bytes(stat.st_size)}: {summary}", value


def _summary(name: str, body: dict[str, Any]) -> str:
    from protrain.profiler.profile import PROFILE_VERSION

    version = body.get("version")
    stale = "" if version == PROFILE_VERSION else f" (version {version}, this build reads {PROFILE_VERSION}: unused)"
    if name.startswith("hardware-"):
        adam = body["cpu_adam_params_per_s"] / 1e6
        rates = f"h2d {format_rate(body['h2d_bytes_per_s'])}, CPU Adam {adam:.0f} M params/s"
        return f"hardware: {body['device_kind']}, world size {body['world_size']}, {rates}{stale}"
    if name.startswith("model-"):
        params = sum(int(numel) for numel, _ in body["param_sizes"])
        shape = " x ".join(str(dim) for dim in body["batch_shape"])
        return (
            f"model: {params / 1e6:,.1f} M parameters, {len(body['blocks'])} blocks, batch {shape}, "
            f"{body['precision']}{stale}"
        )
    return "not a profile this build writes"
