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
    """One engine's view of the process's stop: ``requested`` once a stop signal arrived.

    Signals belong to the process, not to an engine: every live engine's request joins one
    ``_SignalHub``, which installs the handlers with the first request and puts back the ones
    that were there before with the last. So a signal stops every engine of the process alike,
    and closing one of two engines leaves the other's stop working (each engine setting and
    restoring handlers itself would have restored the pre-engine handler under the live one).
    """

    def __init__(self, *, announce: bool = False) -> None:
        self.signum: int | None = None
        self._announce = announce
        self._installed = False

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def announce(self) -> bool:
        return self._announce

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread() and not self._installed:
            self._installed = True
            _HUB.join(self)
        return self

    def uninstall(self) -> None:
        if self._installed:
            self._installed = False
            _HUB.leave(self)


class _SignalHub:
    """The process's stop handlers, shared by the live ``StopRequest``s (see its docstring). The
    first signal raises every request's flag; a second one aborts at once through the handler
    that was in place before."""

    def __init__(self) -> None:
        self._requests: list[StopRequest] = []
        self._previous: dict[int, Any] = {}
        self._signum: int | None = None

    def join(self, request: StopRequest) -> None:
        if not self._requests:
            self._signum = None
            for signum in STOP_SIGNALS:
                if signum in self._previous or signal.getsignal(signum) is signal.SIG_IGN:
                    continue  # still ours (the last request left from another thread), or ignored
                self._previous[signum] = signal.signal(signum, self._on_signal)
        self._requests.append(request)
        if self._signum is not None:
            request.signum = self._signum  # the process is already stopping

    def leave(self, request: StopRequest) -> None:
        if request in self._requests:
            self._requests.remove(request)
        if not self._requests:
            self._restore()

    def _restore(self) -> None:
        """The handlers from before, where this thread may set them (the main thread): the last
        request may leave from another one (an engine dropped and collected there); the hub's
        handler then stays, and passes every signal on (see ``_on_signal``)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self._requests:  # no engine left to stop: the signal is the previous handler's
            self._pass_on(signum, frame)
            return
        if self._signum is None:
            self._signum = signum
            for request in self._requests:
                request.signum = signum
            if any(request.announce for request in self._requests):
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
        for request in self._requests:
            request._installed = False
        self._requests.clear()
        self._pass_on(signum, frame)

    def _pass_on(self, signum: int, frame: FrameType | None) -> None:
        """Put the previous handlers back and give them the signal."""
        previous = self._previous.get(signum, signal.SIG_DFL)
        self._restore()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            sys.exit(128 + signum)


_HUB = _SignalHub()


def stop_signal_received() -> int | None:
    """The stop signal this process received while an engine held the handlers, if any."""
    return _HUB._signum
