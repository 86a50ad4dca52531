"""torch.profiler over every thread the runtime works on, saved as a Chrome trace Perfetto opens.

The pipeline's jobs run on worker threads (the chunks' and the activations' side streams, the
host worker, the SSD I/O threads) under labels (runtime/chunks/trace_labels.py). torch's profiler
records a thread other than the one that started it only when asked to profile every thread
(``_ExperimentalConfig(profile_all_threads=True)``, torch 2.7 and later). On older torch (2.4 to
2.6) a ``ThreadTrace`` profiles the starting thread (and autograd's threads, which inherit its
profiler state) and times every label's range itself (``trace_labels.recording``); ``export``
merges the ranges of threads the profiler did not record into the same JSON, as user
annotations like torch's own, so one file shows every thread either way (their device copies'
launches show only on torch 2.7 and later).

``export`` also names the threads after Python's names for them (``protrain-chunks``,
``protrain-ssd_0``, ...) instead of the profiler's ``thread N (python)``, and gzips the JSON.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from protrain.runtime.chunks import trace_labels

CLOCK_MARK = "trace clock (protrain)"
"""A range on the starting thread whose start both clocks saw: it puts the ranges timed here on
the profiler's time axis."""


def can_profile_every_thread() -> bool:
    """Whether this torch's profiler records every thread (torch 2.7 and later)."""
    from torch._C._profiler import _ExperimentalConfig

    try:
        _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return False
    return True


def profile_every_thread(cuda: bool) -> profile:
    """A ``torch.profiler.profile`` recording CPU operators on every thread (the runtime's
    labelled jobs run on worker threads) and, on CUDA, the device's kernels and copies.
    RuntimeError on a torch that cannot profile every thread (before 2.7)."""
    from torch._C._profiler import _ExperimentalConfig

    if not can_profile_every_thread():
        raise RuntimeError(f"this torch ({torch.__version__}) cannot profile every thread")
    return profile(activities=_activities(cuda), experimental_config=_ExperimentalConfig(profile_all_threads=True))


def _activities(cuda: bool) -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]


class ThreadTrace:
    """One profiler session over every thread (see the module docstring): ``start``, ``stop``,
    then ``export``. ``every_thread``: None takes torch's own where it can; False times the
    labels here even on a torch that could (how the older path is tested)."""

    def __init__(self, *, cuda: bool, every_thread: bool | None = None) -> None:
        self.every_thread = can_profile_every_thread() if every_thread is None else every_thread
        self._profiler = profile_every_thread(cuda) if self.every_thread else profile(activities=_activities(cuda))
        self._recording: contextlib.ExitStack | None = None
        self._ranges: trace_labels.RecordedRanges | None = None
        self._clock_ns = 0
        self._thread_names: dict[int, str] = {}

    def start(self) -> None:
        """Profile from now on (RuntimeError when another profiler is running in this process)."""
        stack = contextlib.ExitStack()
        if not self.every_thread:
            self._ranges = stack.enter_context(trace_labels.recording())
        try:
            self._profiler.start()
        except BaseException:
            stack.close()
            raise
        self._recording = stack
        before = time.time_ns()
        with record_function(CLOCK_MARK):
            pass
        self._clock_ns = (before + time.time_ns()) // 2  # the mark's middle, on this clock
        self._note_threads()

    def stop(self) -> None:
        self._note_threads()
        try:
            self._profiler.stop()
        finally:
            if self._recording is not None:
                self._recording.close()
                self._recording = None

    def _note_threads(self) -> None:
        # Worker threads may have ended by export: their names are taken while they live.
        for thread in threading.enumerate():
            if thread.native_id is not None:
                self._thread_names[thread.native_id] = thread.name

    def export(self, path: Path) -> int:
        """Write the gzipped Chrome trace to ``path``; returns its number of events."""
        handle, raw = tempfile.mkstemp(prefix=".trace-", suffix=".json", dir=path.parent)
        os.close(handle)
        try:
            self._profiler.export_chrome_trace(raw)
            with open(raw, encoding="utf-8") as file:
                trace = json.load(file)
        finally:
            os.unlink(raw)
        events: list[dict[str, Any]] = trace.setdefault("traceEvents", [])
        if self._ranges is not None:
            events += merged_ranges(events, self._ranges.ranges, self._clock_ns)
        name_threads(events, {**self._thread_names, **(self._ranges.threads if self._ranges else {})})
        partial = path.with_name(path.name + ".partial")
        with gzip.open(partial, "wt", encoding="utf-8") as file:
            json.dump(trace, file)
        partial.replace(path)
        return len(events)


def merged_ranges(
    events: list[dict[str, Any]], ranges: list[tuple[str, int, int, int]], clock_ns: int
) -> list[dict[str, Any]]:
    """Chrome events for the ranges timed here on threads where the profiler recorded none of
    that name, on the trace's time axis (``CLOCK_MARK``'s middle is ``clock_ns``: placed within
    microseconds, the mark's own enter and exit)."""
    pid = os.getpid()
    recorded = {(e.get("name"), e.get("tid")) for e in events if e.get("cat") == "user_annotation"}
    marks = [e for e in events if e.get("name") == CLOCK_MARK and e.get("ph") == "X"]
    if not marks:
        raise ValueError("the trace lost its clock mark: the ranges timed here cannot be placed")
    offset_us = float(marks[0]["ts"]) + float(marks[0]["dur"]) / 2 - clock_ns / 1000
    merged = []
    for name, tid, start_ns, end_ns in ranges:
        if (name, tid) in recorded:
            continue
        merged.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": name,
                "pid": pid,
                "tid": tid,
                "ts": start_ns / 1000 + offset_us,
                "dur": (end_ns - start_ns) / 1000,
                "args": {"timed by": "protrain (this torch profiles one thread)"},
            }
        )
    return merged


def name_threads(events: list[dict[str, Any]], names: dict[int, str]) -> None:
    """Thread metadata with Python's thread names, for every thread that has events."""
    pid = os.getpid()
    named: set[Any] = set()
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "thread_name" and event.get("pid") == pid:
            tid = event.get("tid")
            named.add(tid)
            if tid in names:
                event["args"] = {"name": f"{names[tid]} ({tid})"}
    used = {e.get("tid") for e in events if e.get("ph") == "X" and e.get("pid") == pid}
    for tid in sorted(t for t in used - named if isinstance(t, int)):
        label = f"{names[tid]} ({tid})" if tid in names else f"thread {tid}"
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
