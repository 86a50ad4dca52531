"""The console script's target. It imports nothing heavy before it can catch Ctrl-C, so an
interrupt at any moment of start-up ends protrain-run with 130 and no traceback."""

from __future__ import annotations

import sys

EXIT_INTERRUPTED = 130


def run() -> None:
    try:
        from protrain_launcher.cli import main

        code = main()
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    sys.exit(code)
