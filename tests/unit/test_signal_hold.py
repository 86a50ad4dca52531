"""A Ctrl-C (or the agent's SIGTERM) that lands while torch is importing is not lost.

torch's C++ start-up imports NumPy and throws away any exception raised during it, so a
KeyboardInterrupt raised there vanished and protrain-run went on to start the ranks. The signal
is sent from inside NumPy's import here, deterministically, in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A meta-path hook sends the signal the moment torch's start-up begins importing NumPy's core.
CHILD = """
import importlib.abc, os, signal, sys

class SignalOnNumpyCore(importlib.abc.MetaPathFinder):
    fired = False
    def find_spec(self, name, path=None, target=None):
        if name.startswith("numpy._core") and not SignalOnNumpyCore.fired:
            SignalOnNumpyCore.fired = True
            os.kill(os.getpid(), getattr(signal, sys.argv[2]))
        return None

sys.meta_path.insert(0, SignalOnNumpyCore())
if sys.argv[2] == "SIGTERM":
    def on_term(signum, frame):
        raise SystemExit(143)
    signal.signal(signal.SIGTERM, on_term)
try:
    if sys.argv[1] == "held":
        from protrain.launcher.signal_hold import import_torch
        import_torch()
    else:
        import torch
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
print("fired" if SignalOnNumpyCore.fired else "not fired", "and torch imported", flush=True)
"""


def _run(mode: str, signal_name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, mode, signal_name],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts")])},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ctrl_c_during_torch_import_is_delivered_after_it() -> None:
    result = _run("held", "SIGINT")
    assert result.returncode == 130 and "interrupted" in result.stdout, (result.stdout, result.stderr)


def test_sigterm_during_torch_import_still_ends_the_process() -> None:
    result = _run("held", "SIGTERM")
    assert result.returncode == 143 and "torch imported" not in result.stdout, (result.stdout, result.stderr)
