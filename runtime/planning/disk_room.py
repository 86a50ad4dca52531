"""What else the NVMe tier's disk must hold beside its optimizer-state files, so that a disk too
small for all of it is refused before training, not when a checkpoint or an activation file
finds it full: the plan's activation files under the same path, and, when ``checkpoint.dir`` is
on the same filesystem, the checkpoints kept there and the one being written."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from protrain.profiler.host_bytes import checkpoint_staging_bytes
from protrain.profiler.plan import Plan, format_bytes
from protrain.runtime.config.settings import PlanningSettings


def disk_neighbours(
    plan: Plan, planning: PlanningSettings, param_sizes: Sequence[tuple[int, bool]], element_size: int
) -> tuple[int, str]:
    """(bytes per rank, in words) the NVMe tier's disk holds beside its files."""
    if planning.ssd_path is None or plan.n_optimizer <= 0:
        return 0, ""
    total, words = 0, []
    if plan.predicted_ssd_bytes:
        total += plan.predicted_ssd_bytes
        words.append(f"{format_bytes(plan.predicted_ssd_bytes)} of activation files")
    folder = planning.checkpoint_dir
    if folder is not None and _same_filesystem(folder, planning.ssd_path):
        one = checkpoint_staging_bytes(
            list(param_sizes),
            element_size=element_size,
            world_size=plan.world_size,
            optimizer_states=planning.optimizer_states,
        )
        copies = planning.checkpoints_kept + 1  # those kept, and the next one being written
        total += copies * one
        words.append(f"{format_bytes(copies * one)} of checkpoints in {folder} ({copies} of this rank's share)")
    return total, " and ".join(words)


def _same_filesystem(first: Path, second: Path) -> bool:
    return _device(first) == _device(second)


def _device(path: Path) -> int:
    """The filesystem of ``path``, or of its closest existing parent (a folder not made yet)."""
    for candidate in (path, *path.parents):
        try:
            return os.stat(candidate).st_dev
        except OSError:
            continue
    return -1
