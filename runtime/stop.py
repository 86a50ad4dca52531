"""A graceful stop on SIGINT or SIGTERM: finish the step, save a checkpoint, exit.

The first signal only raises a flag. The engine folds the flag into the all-reduce it already
makes at the end of every update window, so all ranks learn of a stop at the same step, even
when the signal reached only one of them (protrain-run's agent sends SIGTERM to each rank in
turn; a rank may be started by hand). The engine then saves a checkpoint, when ``checkpoint.dir``
is set, and raises ``TrainingStopped`` (exit code 128 + signal: 130 for Ctrl-C). A second signal
aborts at once through the handler that was in place before (KeyboardInterrupt for SIGINT,
protrain-run's quiet exit for SIGTERM); a stop only waits at step ends.

A stop requested while no update is under way (before the loop, after it, during an export) is
carried out by ``engine.close()``, which raises ``TrainingStopped`` then. Handlers can only be
set from the main thread; elsewhere (a script driving the engine from a thread) the stop request
is simply not available and the previous behaviour stays. A signal the process ignores (a
background job) stays ignored. The announcement is written straight to file descriptor 2: a
handler may interrupt a print, and printing again from inside it could fail as reentrant.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingStopped(SystemExit):
    """Raised by ``engine.step()`` after a requested stop (and its checkpoint); its exit code is
    128 + the signal number, as if the signal had ended the process."""


class StopRequest:
    def __init__(self, *, announce: bool = False) -> None:
        self.signum: int | None = None
        self._announce = announce
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is signal.SIG_IGN:
                continue
            self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            if self._announce:
                name = signal.Signals(signum).name
                message = (
                    f"{name}: stopping at the end of this step (a checkpoint is saved when "
                    "checkpoint.dir is set); send it again to abort\n"
                )
                try:
                    os.write(2, message.encode())
                except OSError:
                    pass
            return
        previous = self._previous.get(signum, signal.SIG_DFL)
        self.uninstall()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            sys.exit(128 + signum)
