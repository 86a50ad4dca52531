"""Importing torch with stop signals held back, so none is lost.

torch's C++ start-up imports NumPy and swallows any Python exception raised meanwhile (it only
warns that NumPy failed to initialise). A Ctrl-C, or the SIGTERM that stops a rank, landing in
that window raises its KeyboardInterrupt or SystemExit inside NumPy's import and is thrown away:
the launcher went on to start and supervise the ranks as if nothing had been pressed. Blocking
the signals for the import keeps them pending; they are delivered, to the handlers in place, the
moment the import ends.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def signals_held(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Keep ``signals`` pending (not lost) inside the block; deliver them when it ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def import_torch() -> None:
    """Import torch (a no-op when it is already imported) without losing a stop signal."""
    with signals_held():
        import torch  # noqa: F401
