"""Whether this rank's engines caught a stop signal: asked by the launcher's rank entry when a
script fails, to tell a rank that ended on Ctrl-C (a collective broken by a peer that left)
from one that failed. The signal hub holds no torch; with no engine made it never caught one."""

from __future__ import annotations

from protrain.runtime.training.stop import stop_signal_received

__all__ = ["stop_signal_received"]
