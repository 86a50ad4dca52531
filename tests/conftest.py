"""Test-suite shape (DESIGN section 6): tests/unit -> unit (in-process, run with -n 2),
tests/distributed -> dist (2 gloo ranks from a reusable worker pool, one per xdist worker),
tests/e2e -> e2e (real protrain-run processes). The marker follows the folder so no test can be
left out of a run.

Under stream chaos (PROTRAIN_STREAM_CHAOS, runtime/hw/stream_chaos.py) a skipped step raises, so
tests marked ``skips_steps`` (they skip on purpose: a NaN loss, an fp16 overflow) are skipped."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # A suite started in the background by a non-interactive shell (`make test &`) inherits
    # SIGINT ignored, and so would every process a test starts: the Ctrl-C tests would then test
    # nothing. A handler (unlike SIG_IGN) is reset to the default at exec, so children get Python's
    # usual KeyboardInterrupt again.
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The demo's model and corpus (scripts/protrain_demo/) are not part of the product package: the
# tests import them from scripts/, and so do the processes they start.
SCRIPTS = str(Path(__file__).resolve().parents[1] / "scripts")
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)
if SCRIPTS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [SCRIPTS, os.environ.get("PYTHONPATH")]))

if not os.environ.get("PROTRAIN_TESTS_HOME"):
    # Engines without an example batch profile on their first batch and cache the profiles under
    # profiler.cache_dir (~/.cache/protrain by default): tests keep theirs in a scratch home, not
    # the user's. Processes the tests start inherit it; parallel workers share the parent's.
    scratch_home = tempfile.mkdtemp(prefix="protrain-tests-home-")
    os.environ["PROTRAIN_TESTS_HOME"] = os.environ["HOME"] = scratch_home
    atexit.register(shutil.rmtree, scratch_home, True)

# The device wall (runtime/hw/device_wall.py, DESIGN section 6) is up for every test, and for the
# processes tests start: a plan, save or export that would run out of memory on a GPU of the
# budget's size fails here too. PROTRAIN_STRICT_DEVICE=0 lowers it (a benchmark's figures).
os.environ.setdefault("PROTRAIN_STRICT_DEVICE", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Parallel workers share the cores: one compute thread each (as torchrun gives each rank a
    # share), set before any test imports torch. With a thread per core in every worker, OpenMP
    # threads spinning for each other made the in-process tests 5-10x slower.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

_MARKERS = {"unit": pytest.mark.unit, "distributed": pytest.mark.dist, "e2e": pytest.mark.e2e}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        marker = _MARKERS.get(folder)
        if marker is not None:
            item.add_marker(marker)
    from protrain.runtime.hw import stream_chaos  # here, not at the top: torch after OMP_NUM_THREADS is set

    if stream_chaos.enabled():
        chaos_skip = pytest.mark.skip(reason="skips steps on purpose; stream chaos refuses skipped steps")
        for item in items:
            if item.get_closest_marker("skips_steps") is not None:
                item.add_marker(chaos_skip)


@pytest.fixture
def chaos(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """``chaos(mode, seed=0)``: switch stream chaos on for what is built next (workers and pools
    read it when they are made); the environment is restored after the test."""
    from protrain.runtime.hw import stream_chaos

    def switch(mode: str, seed: int = 0) -> None:
        monkeypatch.setenv(stream_chaos.ENV, mode)
        monkeypatch.setenv(stream_chaos.SEED_ENV, str(seed))

    return switch


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every module the tests import is loaded now: move its objects out of the collector's
    view (``gc.freeze``). Each engine after a process's first collects garbage before it claims the
    device (runtime/training/live_engines.py), and a full collection over torch's and transformers'
    objects takes ~0.2 s: over the suite's hundreds of engines, minutes on 2 cores."""
    import gc

    gc.collect()
    gc.freeze()
