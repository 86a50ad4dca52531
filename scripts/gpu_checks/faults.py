"""Two stages that go wrong on purpose, for ``gpu_check.py --first-contact --rehearse
--inject-fault raise hang`` (the suite's test of the first-contact run): one raises after its
first check, one hangs after its first check. The run must report both (an error with its
traceback; a timeout with every thread's stack in the log) and go on with the stages after them.
"""

from __future__ import annotations

import threading

from gpu_checks.common import Context, Section


def _raise(ctx: Context) -> None:
    ctx.check("before the injected failure", None, "a check recorded before the stage raises")
    raise RuntimeError("injected failure (--inject-fault raise)")


def _hang_forever(ctx: Context) -> None:
    ctx.check("before the injected hang", None, "a check recorded before the stage hangs")
    threading.Event().wait()  # never set: the child's faulthandler ends it at its timeout


RAISES = Section(
    name="fault_raise", title="injected: a stage that raises", run=_raise, cpu_counterpart="none (a fault)"
)
HANGS = Section(
    name="fault_hang", title="injected: a stage that hangs", run=_hang_forever, cpu_counterpart="none (a fault)"
)
