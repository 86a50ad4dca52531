"""What protrain-run's front end (``cli``: read and check the command line and the spec) hands
its back end (``launch``: start the ranks), and the exit codes both give back.

It imports nothing heavy at run time (the standard library only; ``Override`` is named for type
checkers alone): the console entry point and every rank read the exit codes before their Ctrl-C
and SIGTERM handling is in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protrain.launcher.slurm import SlurmJob
    from protrain.runtime.config.spec_io import Override

EXIT_OK = 0
EXIT_RANK_FAILED = 1
"""A rank failed (an exception in the training script, a crash)."""
EXIT_BAD_INPUT = 2
"""Bad input: found before any rank started, or by the ranks while planning (a SpecError)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (or SIGTERM) of the launcher."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchRequest:
    """The command line, parsed: what to run and the spec's sources, in the order they apply."""

    script: Path
    script_args: tuple[str, ...]
    """The script's own arguments: those after the script path, then those after ``--``."""
    config: Path | None
    """``--config``; None: the spec's defaults."""
    overrides: tuple[Override, ...]
    """``--set`` overrides, in command-line order."""
    launcher_overrides: tuple[Override, ...]
    """Launcher options (``--nproc-per-node`` ...) as overrides of the launcher section; they win."""
    dry_run: bool
    slurm: SlurmJob | None = None
    """The ``srun`` job this task belongs to (``slurm.py``): its nodes, this node, the job id."""
    hostfile: Path | None = None
    """``--hostfile``: this protrain-run starts one per host (``multinode.py``)."""
    include: str | None = None
    exclude: str | None = None
    node_argv: tuple[str, ...] = ()
    """The command line without ``--hostfile``/``--include``/``--exclude``: what each node runs."""
