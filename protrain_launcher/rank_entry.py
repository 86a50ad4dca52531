"""What each rank runs: ``python -m protrain.launcher.rank_entry train.py [args]``.

It ties the rank's life to the launcher (a rank dies when the launcher dies, even by SIGKILL),
turns SIGINT/SIGTERM into a quiet exit (130/143, no traceback; ``finally`` blocks still run;
an error after an engine took the signal, a collective broken by a peer that stopped at once,
is the same stop and ends the same way, in one line),
and runs the user's script as ``__main__``. An exception in the script is recorded for the
elastic agent (its error file) and printed, and the rank exits 1. Bad input found inside the
rank (a ``SpecError``: hand-set knobs no plan can honour, say) is the user's to fix, not a crash:
its message alone goes to the launcher (through the error file, or to stderr when there is no
agent, as in a dry run), no traceback, and the rank exits 2, as protrain-run does on bad input.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import signal
import sys
import time
from types import FrameType

from protrain.launcher.env_names import (
    BAD_INPUT_PREFIX,
    ERROR_FILE_ENV,
    LAUNCHER_PID_ENV,
    LOCAL_RANK_ENV,
    LOCAL_WORLD_SIZE_ENV,
)

# standard library only: nothing heavy yet
from protrain.launcher.request import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, EXIT_RANK_FAILED
from protrain.launcher.signal_hold import import_torch

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


OPTIONAL_EXTRAS = {"transformers": "hf", "peft": "hf", "tensorboard": "logging", "matplotlib": "plot"}
"""Packages ProTrain's extras provide: a script that misses one gets one line naming the extra."""


def run_script(script: str, args: list[str]) -> int:
    """Run the script; returns the rank's exit code (0, or EXIT_BAD_INPUT after a SpecError)."""
    # torch is imported only now, after the signal handlers are in place, and with the stop
    # signals held during the import (see signal_hold): a SIGTERM then still ends the rank quietly.
    import_torch()
    from torch.distributed.elastic.multiprocessing.errors import record

    from protrain.runtime.config.spec_io import SpecError

    def run() -> int:
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        try:
            runpy.run_path(script, run_name="__main__")
        except SpecError as err:
            report_bad_input(err)
            return EXIT_BAD_INPUT
        except ModuleNotFoundError as err:
            extra = OPTIONAL_EXTRAS.get((err.name or "").split(".")[0])
            if extra is None:
                raise
            report_bad_input(ValueError(f"{err.name} is not installed: pip install 'protrain[{extra}]'"))
            return EXIT_BAD_INPUT
        except Exception as err:
            # The engines' signal hub (torch-free; it caught nothing where no engine was made).
            from protrain.runtime.commands.stop import stop_signal_received

            signum = stop_signal_received()
            if signum is None:
                raise
            # Ctrl-C reached every rank: one that had no engine yet left at once, so this one,
            # waiting to finish its step, finds a collective broken. That is the same stop.
            name = signal.Signals(signum).name
            print(f"protrain-run: stopped by {name}; then: {str(err).splitlines()[0][:200]}", file=sys.stderr)
            raise SystemExit(128 + signum) from None
        return 0

    return record(run)() or 0


def report_bad_input(err: Exception) -> None:
    """Hand the message to the launcher through the agent's error file (the launcher prints it
    once, whichever ranks failed), or print it when no agent runs this rank."""
    error_file = os.environ.get(ERROR_FILE_ENV)
    if not error_file:
        print(f"protrain-run: error: {err}", file=sys.stderr, flush=True)
        return
    # The format torch's ErrorHandler.record_exception writes, without the traceback.
    message = {"message": f"{BAD_INPUT_PREFIX}{err}", "extraInfo": {"timestamp": str(int(time.time()))}}
    with open(error_file, "w", encoding="utf-8") as file:
        json.dump({"message": message}, file)


def take_local_place() -> None:
    """One Slurm task per GPU: this rank's place among its node's ranks is the task's."""
    for ours, torchs in ((LOCAL_RANK_ENV, "LOCAL_RANK"), (LOCAL_WORLD_SIZE_ENV, "LOCAL_WORLD_SIZE")):
        if os.environ.get(ours):
            os.environ[torchs] = os.environ[ours]


def main() -> None:
    try:
        die_with_parent()
        take_local_place()
        signal.signal(signal.SIGTERM, _on_sigterm)
        if len(sys.argv) < 2:
            print("usage: python -m protrain.launcher.rank_entry SCRIPT [ARGS...]", file=sys.stderr)
            code = EXIT_BAD_INPUT
        else:
            code = run_script(sys.argv[1], sys.argv[2:])
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except SystemExit as stop:  # a stop (TrainingStopped, SIGTERM) or the script's own exit
        code = _exit_code(stop)
    except BaseException:  # noqa: BLE001 - the script's error: recorded for the agent, printed here
        sys.excepthook(*sys.exc_info())
        code = EXIT_RANK_FAILED
    # Every end leaves the same way: a stop or a failure reaches here while the engine's worker
    # threads may still be running torch work, and the interpreter's teardown would then abort
    # the rank ("terminate called without an active exception") instead of exiting 130 or 1.
    finish_cleanly(code, destroy_group=code in (EXIT_OK, EXIT_BAD_INPUT))


def _exit_code(stop: SystemExit) -> int:
    """The exit status ``sys.exit(code)`` asks for, as the interpreter reads it."""
    if stop.code is None:
        return EXIT_OK
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return EXIT_RANK_FAILED


def finish_cleanly(code: int = 0, *, destroy_group: bool = True) -> None:
    """End a rank without the interpreter's teardown. Finalisation destroys torch's C++ objects
    in no fixed order while its worker threads (the engine's, gloo's, the intra-op pool) may
    still be running; one of them then hitting a torn-down interpreter aborts with "terminate
    called without an active exception" (seen in CI after a run had finished and after Ctrl-C;
    see pytorch/pytorch#179291). The script's atexit handlers run (they close a dropped engine
    and finish a checkpoint written in the background) and, after a clean end
    (``destroy_group``), the process group is destroyed, while everything is alive; then the
    process leaves with ``code``. After a stop or a failure the group is left to the exit: a
    peer may be gone or inside a collective."""
    import atexit

    # The script's atexit handlers first: one may still need the process group (a checkpoint
    # being written in the background finishes there).
    atexit._run_exitfuncs()
    distributed = sys.modules.get("torch.distributed")
    if destroy_group and distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
