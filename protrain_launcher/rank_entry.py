"""What each rank runs: ``python -m protrain_launcher.rank_entry train.py [args]``.

It ties the rank's life to the launcher (a rank dies when the launcher dies, even by SIGKILL),
turns SIGINT/SIGTERM into a quiet exit (130/143, no traceback; ``finally`` blocks still run),
and runs the user's script as ``__main__``. An exception in the script is recorded for the
elastic agent (its error file) and printed, and the rank exits 1.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
from types import FrameType

from protrain_launcher.env_names import LAUNCHER_PID_ENV
from protrain_launcher.signal_hold import import_torch

_PR_SET_PDEATHSIG = 1


class Terminated(SystemExit):
    """SIGTERM from the launcher (another rank failed, or shutdown)."""


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux); if the launcher is
    already gone, exit now."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    expected = os.environ.get(LAUNCHER_PID_ENV)
    if expected and os.getppid() != int(expected):
        os._exit(1)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated(128 + signal.SIGTERM)


def run_script(script: str, args: list[str]) -> None:
    # torch is imported only now, after the signal handlers are in place, and with the stop
    # signals held during the import (see signal_hold): a SIGTERM then still ends the rank quietly.
    import_torch()
    from torch.distributed.elastic.multiprocessing.errors import record

    def run() -> None:
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")

    record(run)()


def main() -> None:
    try:
        die_with_parent()
        signal.signal(signal.SIGTERM, _on_sigterm)
        if len(sys.argv) < 2:
            print("usage: python -m protrain_launcher.rank_entry SCRIPT [ARGS...]", file=sys.stderr)
            sys.exit(2)
        run_script(sys.argv[1], sys.argv[2:])
    except KeyboardInterrupt:
        sys.exit(130)
    finish_cleanly()


def finish_cleanly() -> None:
    """End a rank whose script succeeded without the interpreter's teardown. Finalisation
    destroys torch's C++ objects in no fixed order while its worker threads may still be
    running; a gloo or thread-pool thread then hitting a torn-down interpreter aborts with
    "terminate called without an active exception" (seen in CI after a run had finished; see
    pytorch/pytorch#179291). The script's atexit handlers run and the process group is destroyed
    here, while everything is alive, then the process leaves with exit code 0."""
    import atexit

    # The script's atexit handlers first: one may still need the process group (a checkpoint
    # being written in the background finishes there).
    atexit._run_exitfuncs()
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
