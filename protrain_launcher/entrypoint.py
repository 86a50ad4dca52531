"""The console script's target. It imports nothing heavy before it can catch Ctrl-C, so an
interrupt at any moment of start-up ends protrain-run with 130 and no traceback."""

from __future__ import annotations

import os
import sys

from protrain.launcher.request import EXIT_INTERRUPTED


def run() -> None:
    try:
        from protrain.launcher.cli import main

        code = main()
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    if code == EXIT_INTERRUPTED:
        # A KeyboardInterrupt that Python saw anywhere (an import, a helper thread) makes the
        # interpreter end itself by SIGINT at exit, whatever code was asked for; the job's own
        # cleanup is done by now, so leave with the exit code the user is promised.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
