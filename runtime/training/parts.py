"""What an Engine owns and gives back: one object, shared by the Engine and its finalizer.

An engine holds worker threads (side streams, the host worker), host regions (the chunk state's
arena, staging rings, the swap pool), hooks on the caller's model, activation files, a process
group, the stop-signal handlers and its claim on the device (runtime/training/live_engines.py).
``EngineParts`` holds them all and nothing that refers to the Engine, so an engine dropped
without ``close()`` (a notebook cell run again, a Trainer nobody ended, an exception) gives them
back once it is unreachable: ``weakref.finalize`` on the Engine closes its parts. The model's
hooks refer to the parts, never to the Engine, so a model kept after its engine is dropped does
not keep the engine alive (and is left with its engine's hooks removed).

A plan switch replaces ``chunks`` and ``activations`` here; whoever reads them through the parts
(the metrics, the finalizer) follows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from protrain.runtime.activations.manager import ActivationManager
from protrain.runtime.checkpoint.checkpointer import Checkpointer
from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.hw.distributed import DistContext, release
from protrain.runtime.tracing.trace_window import UpdateObserver
from protrain.runtime.training.live_engines import EngineClaim
from protrain.runtime.training.reporting import UpdateReports
from protrain.runtime.training.stop import StopRequest


@dataclass(eq=False, kw_only=True)
class EngineParts:
    """An engine's managers and resources (see the module docstring)."""

    chunks: ChunkManager
    activations: ActivationManager
    checkpointer: Checkpointer
    dist_ctx: DistContext
    reports: UpdateReports | None = None
    trace: UpdateObserver | None = None
    stop: StopRequest | None = None
    claim: EngineClaim | None = None
    closed: bool = False

    def close(self) -> None:
        """Give everything back, each part even if another fails: the probe's hooks leave the
        model, the stop handlers go, an asynchronous save finishes, then the trace, the reports,
        the managers (threads, hooks, host regions, activation files), the process group and
        the claim. Once; the first failure is raised after the rest is closed."""
        if self.closed:
            return
        self.closed = True
        with contextlib.ExitStack() as closing:  # last in, first closed
            closing.callback(self._release_claims)
            closing.callback(self.chunks.close)
            closing.callback(self.activations.close)
            if self.reports is not None:
                closing.callback(self.reports.close)
            if self.trace is not None:
                closing.callback(self.trace.close)
            closing.callback(self.checkpointer.close)
            if self.stop is not None:
                closing.callback(self.stop.uninstall)
            if self.reports is not None:
                closing.callback(self.reports.stop_probe)

    def _release_claims(self) -> None:
        # Whatever failed before, the group and the claim go: another engine of the process may
        # still be training and must be able to close (and claim) after this one.
        try:
            release(self.dist_ctx)
        finally:
            if self.claim is not None:
                self.claim.release()


def close_dropped(parts: EngineParts) -> None:
    """The finalizer of an Engine nobody closed: its parts close as ``close()`` would have
    closed them (without the stop a pending signal asks for: nobody is left to stop). It may
    run on any thread the garbage collector runs on; a failure is said, not raised (there is
    no caller to raise it to)."""
    try:
        parts.close()
    except Exception as err:  # noqa: BLE001 - a finalizer has no caller
        print(f"protrain: closing an engine nobody closed failed: {err}", flush=True)
